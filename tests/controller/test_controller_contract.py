"""The wire contract between agents and the controller, checked against the code itself:
every event field the controller reads is sent by some agent path, and every error says
whether it is retryable under a code of its own."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import spotguard
from spotguard import errors
from spotguard.agent.reporter import Reporter
from spotguard.contracts import EVENT_MODELS, WireError
from spotguard.controller import machine

SRC = Path(spotguard.__file__).parent
#: Fields every event has by construction (defaults the models fill, or the reporter stamps).
ALWAYS = {"schema_version", "event_id", "job", "kind", "at"}
CONTROLLER = [
    SRC / "controller" / n for n in ("machine.py", "reportfacts.py", "core.py", "reconcile.py")
]


def _class_names(annotation: ast.expr | None) -> set[str]:
    """Event class names in a parameter annotation (``A | B``, ``A``)."""
    if annotation is None:
        return set()
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} & {
        m.__name__ for m in EVENT_MODELS.values()
    }


def fields_read() -> dict[str, set[str]]:
    """Event class → fields the controller reads from it: ``ev.<field>`` in every function
    whose ``ev`` is annotated with that class, and ``isinstance(ev, Class)`` narrowing."""
    out: dict[str, set[str]] = {m.__name__: set() for m in EVENT_MODELS.values()}
    for path in CONTROLLER:
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            classes = set()
            for arg in fn.args.args:
                if arg.arg == "ev":
                    classes |= _class_names(arg.annotation)
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance"
                    and isinstance(node.args[0], ast.Attribute | ast.Name)
                ):
                    classes |= _class_names(node.args[1])
            attrs = {
                n.attr
                for n in ast.walk(fn)
                if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Attribute | ast.Name)
                and getattr(n.value, "id", getattr(n.value, "attr", None)) == "ev"
            }
            for cls in classes:
                model = next(m for m in EVENT_MODELS.values() if m.__name__ == cls)
                out[cls] |= attrs & set(model.model_fields)
    return out


def fields_sent() -> dict[str, set[str]]:
    """Event class → keyword fields some sender constructs it with: code outside the
    controller (the agent), and the controller's fleet source, which reports notices seen
    outside the VM (``Controller.handle_notice``) as an agent would."""
    out: dict[str, set[str]] = {m.__name__: set() for m in EVENT_MODELS.values()}
    core = ast.parse((SRC / "controller" / "core.py").read_text())
    fleet = next(
        n
        for n in ast.walk(core)
        if isinstance(n, ast.AsyncFunctionDef) and n.name == "handle_notice"
    )
    trees: list[ast.AST] = [fleet]
    trees += [ast.parse(p.read_text()) for p in SRC.rglob("*.py") if p.parent.name != "controller"]
    for tree in trees:
        for node in ast.walk(tree):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in out:  # type: ignore[attr-defined]
                out[node.func.id] |= {k.arg for k in node.keywords if k.arg}  # type: ignore[attr-defined]
    return out


def test_every_field_the_controller_reads_is_sent_by_some_agent_path() -> None:
    read, sent = fields_read(), fields_sent()
    assert read["RestoreFailedEvent"] >= {"error", "image_url"}  # the checker sees reads
    assert read["DurableEvent"] >= {"image_url", "mode", "image_bytes"}
    stamped = set(Reporter.STAMPED)
    missing = {
        cls: sorted(fields - sent[cls] - ALWAYS - stamped)
        for cls, fields in read.items()
        if fields - sent[cls] - ALWAYS - stamped
    }
    assert not missing, f"the controller reads fields no agent path sends: {missing}"


def test_the_controller_decides_by_wire_errors_not_class_names() -> None:
    source = inspect.getsource(machine)
    for cls in ("ImageCorrupt", "PreflightError", "MismatchError", "DecryptionError"):
        assert cls not in source
    assert "retryable" in source and "image_fault" in source


def _tree(cls: type[errors.SpotguardError]) -> list[type[errors.SpotguardError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _tree(sub)
    return out


def test_every_error_says_if_it_is_retryable_under_a_unique_code() -> None:
    classes = [c for c in _tree(errors.SpotguardError) if c.__module__ == "spotguard.errors"]
    assert len(classes) > 30
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), "two errors share a code"
    for c in classes:  # said by the class or its family (an ImageError is not retryable)
        assert isinstance(c.retryable, bool) and isinstance(c.image_fault, bool), c
    assert errors.ImageCorrupt.code == "image_corrupt"
    assert (errors.StoreUnavailable.retryable, errors.PrecheckError.retryable) == (True, False)
    wire = WireError.of(errors.ImageCorrupt("chunk ab failed", chunk="ab"))
    assert (wire.code, wire.retryable, wire.image_fault) == ("image_corrupt", False, True)
    assert WireError.of(KeyError("x")).code == "internal"
