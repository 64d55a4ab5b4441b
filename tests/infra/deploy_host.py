"""One host, deployed as docs/deploy-aws.md says, inside its own namespaces (run by
tests/infra/test_infra_deploy_host.py as ``unshare -m -n -p -f --mount-proc``: PID 1 here).

``/etc`` and ``/var/lib`` are overlays (writes stay in WORK), ``/run`` a fresh tmpfs and the
network namespace has only loopback, so the documented paths and the rendered ``listen =
"0.0.0.0:8700"`` are used exactly as written, without touching the real host; when this process
exits the kernel ends every process it started. AWS is a moto server, the instance metadata
service spotguard's metadata-sim. The machine plays the controller host first, then the job VM.

Steps: the module's ``controller_config`` rendered by ``terraform console`` from its own
template; /etc/spotguard installed as the docs say (config, admin token, TLS certificate and key
from openssl, root-only); the controller started with its unit's settings (credentials copied
to /run/credentials/spotguard-controller.service, its dynamic user, StateDirectory) and
``spotguard controller --issue-token train-llm`` as the docs say; the launch template's
first-boot user-data rendered with that token and run by bash (``systemctl`` recorded); the
agent unit's ExecStartPre (``fetch-keys``, from Secrets Manager / SSM) and ExecStart; then a
rebalance notice, and the controller is asked (as the operator, over HTTPS) what it heard.

In private mode (``controller_tls = false``) the agent reaches the controller at
``http://10.88.0.1:8700``, an address added to the namespace's loopback device that is not a
loopback address: the agent refuses plain HTTP to such a host unless the first-boot config says
``insecure_controller = true``, as the module writes it in that mode.

``CLOUD`` gcp plays docs/deploy-gcp.md's controller host from the GCP module's templates and
runs its first-boot startup script (the job started, the agent's config and token written);
its agent is not started (no GCS or GCE metadata here).

Usage: deploy_host.py WORK MODE [CLOUD] (MODE: tls | private; CLOUD: aws | gcp, default
aws). Writes WORK/report.json.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODULES = {cloud: ROOT / "terraform" / cloud / "modules" / "spotguard" for cloud in ("aws", "gcp")}
MODULE = MODULES["aws"]  # main() sets the cloud's
#: the controller host's private-network address in private mode: on lo, but not loopback
PRIVATE_IP = "10.88.0.1"
UNITS = ROOT / "packaging" / "systemd"
UID = 65534
JOB = "train-llm"
REGION = "us-east-1"
BUCKET = "spotguard-demo-images-123456789012-us-east-1"
ADMIN = "admin-token-never-on-a-vm-0123456789"
BIN = Path(sys.executable).parent
CRED_DIR = Path("/run/credentials/spotguard-controller.service")


def sh(*cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def unit(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def isolate(work: Path) -> None:
    """Overlays on /etc and /var/lib, a fresh /run, loopback up."""
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "addr", "add", f"{PRIVATE_IP}/32", "dev", "lo")
    for target in ("/etc", "/var/lib"):
        name = target.strip("/").replace("/", "_")
        upper, wdir = work / "overlay" / name, work / "overlay" / f"{name}.work"
        upper.mkdir(parents=True)
        wdir.mkdir(parents=True)
        sh("mount", "-t", "overlay", "overlay", "-o",
           f"lowerdir={target},upperdir={upper},workdir={wdir}", target)  # fmt: skip
    sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run")


def render(template: str, tvars: dict[str, Any], cwd: Path) -> str:
    """``templatefile()`` of the module's own template, by ``terraform console``."""
    tpl = MODULE / "templates" / template
    expr = (
        f"base64encode(templatefile({json.dumps(str(tpl))}, "
        f"jsondecode({json.dumps(json.dumps(tvars))})))"
    )
    out = sh("terraform", "console", input=expr, cwd=cwd)
    return base64.b64decode(out.stdout.strip().strip('"')).decode()


def module_paths() -> dict[str, str]:
    import hcl2

    with (MODULE / "main.tf").open() as f:
        doc = hcl2.load(f)
    for block in doc["locals"]:
        if "spotguard" in block:
            value = block["spotguard"]
            return dict(value[0] if isinstance(value, list) else value)
    raise AssertionError("no local.spotguard in main.tf")


def free_port() -> int:
    """A free local port (this script runs on its own, inside the deploy test's namespaces,
    without the suite's ``tests/`` on ``sys.path``: no ``sgtest`` here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, ctx: ssl.SSLContext | None, proc: subprocess.Popen[str]) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
        try:
            with urllib.request.urlopen(url, timeout=1, context=ctx):
                return
        except urllib.error.HTTPError:
            return  # it answers (IMDSv2 wants a token first)
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def aws_fixtures(endpoint: str, verify_key: str, signing_key: str) -> dict[str, str]:
    import boto3

    kw: dict[str, Any] = {"endpoint_url": endpoint, "region_name": REGION}
    queue = boto3.client("sqs", **kw).create_queue(QueueName="spotguard-demo-events")["QueueUrl"]
    boto3.client("s3", **kw).create_bucket(Bucket=BUCKET)
    secret = boto3.client("secretsmanager", **kw).create_secret(
        Name=f"spotguard-demo/image-signing-key/{JOB}", SecretString=signing_key
    )["ARN"]
    ssm = boto3.client("ssm", **kw)
    name = f"/spotguard-demo/image-verify-key/{JOB}"
    ssm.put_parameter(Name=name, Value=verify_key, Type="String")
    param = ssm.get_parameter(Name=name)["Parameter"]["ARN"]
    return {
        "queue": queue,
        "signing": f"aws-secretsmanager:{secret}",
        "verify": f"aws-ssm:{param}",
        "verify_key": verify_key,
        "store": f"s3://{BUCKET}",
    }


def tls_files(etc: Path) -> Path:
    """A self-signed certificate for the controller (as an operator's CA would issue one),
    and the VM image trusting it (what update-ca-certificates does)."""
    sh("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
       "-nodes", "-days", "2", "-subj", "/CN=controller.internal.example",
       "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
       "-keyout", str(etc / "controller.key"), "-out", str(etc / "controller.crt"))  # fmt: skip
    for name in ("controller.crt", "controller.key"):
        (etc / name).chmod(0o600)
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    with bundle.open("a") as f:
        f.write((etc / "controller.crt").read_text())
    return etc / "controller.crt"


def load_credentials(svc: dict[str, list[str]]) -> dict[str, str]:
    """What systemd does for the unit's LoadCredential=/SetCredential= (a missing file takes
    its SetCredential= value), ``%d`` expanded."""
    CRED_DIR.mkdir(parents=True)
    fallback = dict(v.partition(":")[::2] for v in svc.get("SetCredential", []))
    loaded = []
    for spec in svc.get("LoadCredential", []):
        cred_id, _, source = spec.partition(":")
        dst = CRED_DIR / cred_id
        if Path(source).is_file():
            shutil.copyfile(source, dst)
        else:
            assert cred_id in fallback, f"LoadCredential {source} missing, no SetCredential"
            dst.write_text(fallback[cred_id])
        os.chown(dst, UID, UID)
        dst.chmod(0o400)
        loaded.append(cred_id)
    os.chown(CRED_DIR, UID, UID)
    CRED_DIR.chmod(0o500)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "CREDENTIALS_DIRECTORY": str(CRED_DIR)}
    for assignment in svc.get("Environment", []):
        key, _, value = assignment.partition("=")
        env[key] = value.replace("%d", str(CRED_DIR))
    return env


def start_controller(endpoint: str) -> subprocess.Popen[str]:
    svc = unit("spotguard-controller.service")
    env = load_credentials(svc)
    (state_name,) = svc["StateDirectory"]
    state = Path("/var/lib") / state_name
    state.mkdir(mode=0o700)
    os.chown(state, UID, UID)
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    env |= {"PYTHONPATH": f"{ROOT / 'src'}:{site}", "HOME": str(state)}
    if endpoint:  # AWS is the moto server
        env |= {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
        }
    (execstart,) = svc["ExecStart"]
    argv = shlex.split(execstart)
    assert argv[0] == "/usr/local/bin/spotguard"
    cmd = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "/usr/bin/python3"]
    return subprocess.Popen(
        [*cmd, "-m", "spotguard", *argv[1:]], env=env, cwd=state, text=True,
        stdout=subprocess.DEVNULL, stderr=open("/run/controller.log", "w"),
    )  # fmt: skip


def first_boot(
    work: Path, paths: dict[str, str], keys: dict[str, str], url: str, token: str, *, tls: bool
) -> str:
    command = "i=0; while :; do i=$((i+1)); echo step $i; sleep 0.2; done"
    script = render(
        "first-boot.sh.tftpl",
        {
            "job": JOB,
            "store_url": keys["store"],
            "controller_url": url,
            "insecure_controller": not tls,  # the module: !var.controller_tls
            "job_token": token,
            "key_sources": {"signing": keys["signing"], "verify": keys["verify"]},
            "command": command,
            "paths": paths,
            "run_command": paths["run_command"] % (JOB, paths["job_script_path"]),
        },
        work,
    )
    shim = work / "shim"
    shim.mkdir()
    (shim / "systemctl").write_text(f'#!/bin/sh\necho "$@" >> {work}/systemctl.calls\n')
    (shim / "systemctl").chmod(0o755)
    (work / "first-boot.sh").write_text(script)
    env = dict(os.environ, PATH=f"{shim}:{BIN}:/usr/bin:/bin")
    sh("bash", str(work / "first-boot.sh"), env=env)
    return script


def start_agent(work: Path, sim: str, endpoint: str) -> subprocess.Popen[str]:
    """The agent unit: its environment, EnvironmentFile=-/etc/default/spotguard (here: where
    AWS and its metadata service are), ExecStartPre fetch-keys, keys.env, ExecStart."""
    svc = unit("spotguard-agent.service")
    Path("/etc/default/spotguard").write_text(
        f"AWS_ENDPOINT_URL={endpoint}\nAWS_ACCESS_KEY_ID=testing\nAWS_SECRET_ACCESS_KEY=testing\n"
        f"AWS_DEFAULT_REGION={REGION}\nAWS_EC2_METADATA_SERVICE_ENDPOINT={sim}\n"
    )
    Path("/run/spotguard").mkdir(mode=0o700)
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}

    def env_file(path: str) -> None:
        p = Path(path.lstrip("-"))
        if p.is_file():
            for line in p.read_text().splitlines():
                if "=" in line and not line.startswith("#"):
                    k, _, v = line.partition("=")
                    env[k.strip()] = v.strip()

    for assignment in svc["Environment"]:
        key, _, value = assignment.partition("=")
        env[key] = value
    files = svc["EnvironmentFile"]
    env_file(files[0])
    for pre in svc["ExecStartPre"]:
        argv = shlex.split(pre)
        sh(str(BIN / "spotguard"), *argv[1:], env=env)
    env_file(files[1])
    (execstart,) = svc["ExecStart"]
    argv = shlex.split(execstart)
    return subprocess.Popen(
        [str(BIN / "spotguard"), *argv[1:]], env=env, text=True,
        stdout=subprocess.DEVNULL, stderr=open("/run/agent.log", "w"),
    )  # fmt: skip


def admin_get(url: str, ctx: ssl.SSLContext | None) -> dict[str, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
        return dict(json.loads(r.read()))


def controller_vars(
    cloud: str, url: str, tls: bool, paths: dict[str, str], keys: dict[str, str]
) -> dict[str, Any]:
    """The arguments the module's outputs.tf passes to its controller template."""
    tvars: dict[str, Any] = {
        "listen": "0.0.0.0:8700",  # the module's default controller_listen, as rendered
        "advertise_url": url,
        "store_url": keys["store"],
        "token_path": paths["token_path"],
        "tls": tls,
        "credentials_dir": paths["credentials_dir"],
        "signing_key_sources": {JOB: keys["signing"]},
        "verify_key_sources": {JOB: keys["verify"]},
        "verify_key": keys["verify_key"],
    }
    if cloud == "aws":
        return tvars | {
            "queue_url": keys["queue"],
            "region": REGION,
            "launch_template": "spotguard-demo-{job}",
            "subnets": {},
        }
    return tvars | {
        "project": "my-project",
        "zones": ["us-central1-a", "us-central1-b"],
        "image": "projects/my-project/global/images/family/spotguard",
        "network": "global/networks/default",
        "subnetwork": None,
        "disk_gb": 200,
        "termination_action": "DELETE",
        "job_accounts": {JOB: "spotguard-1a2b3c4d5e@my-project.iam.gserviceaccount.com"},
    }


def gcp_fixtures(verify_key: str) -> dict[str, str]:
    """What the GCP module names (nothing here serves them: its agent is not started)."""
    secrets = "gcp-secretmanager:projects/my-project/secrets/spotguard-demo"
    return {
        "store": "gs://my-project-spotguard-demo-images",
        "signing": f"{secrets}-signing-key-{JOB}",
        "verify": f"{secrets}-verify-key-{JOB}",
        "verify_key": verify_key,
    }


def wait_status(agent: subprocess.Popen[str]) -> dict[str, Any]:
    """``spotguard status --json`` once the agent has taken up the job (or has stopped)."""
    status: dict[str, Any] = {}
    for _ in range(300):
        out = subprocess.run(
            [str(BIN / "spotguard"), "status", "--json"], capture_output=True, text=True
        )
        if out.returncode == 0:
            status = json.loads(out.stdout)
            # the agent answers before it has taken up its jobs: wait for the job
            if any(j.get("job") == JOB for j in status.get("jobs", [])):
                break
        if agent.poll() is not None:
            break
        time.sleep(0.2)
    return status


def main(work: Path, mode: str, cloud: str = "aws") -> dict[str, Any]:
    global MODULE
    from moto.server import ThreadedMotoServer

    from spotguard.image.keys import generate_signing_key

    MODULE = MODULES[cloud]
    report: dict[str, Any] = {"mode": mode, "cloud": cloud}
    isolate(work)
    private, public = generate_signing_key()
    endpoint = ""
    if cloud == "aws":
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        moto.start()
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ |= {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        keys = aws_fixtures(endpoint, public.decode().strip(), private.decode())
    else:
        keys = gcp_fixtures(public.decode().strip())
    paths = module_paths()
    tls = mode == "tls"
    # private mode: the controller host's network address, not loopback (the agent must opt in)
    url = "https://127.0.0.1:8700" if tls else f"http://{PRIVATE_IP}:8700"
    report["url"] = url

    # --- the controller host (docs/deploy-*.md step 3) ---
    config = render("controller.toml.tftpl", controller_vars(cloud, url, tls, paths, keys), work)
    report["controller_config"] = config
    etc = Path(paths["etc_dir"])
    etc.mkdir(mode=0o700)
    (etc / "spotguard.toml").write_text(config)
    (etc / "spotguard.toml").chmod(0o600)
    Path(paths["token_path"]).write_text(ADMIN + "\n")
    Path(paths["token_path"]).chmod(0o600)
    ctx = ssl.create_default_context(cafile=str(tls_files(etc))) if tls else None
    controller = start_controller(endpoint)
    try:
        wait_http(f"{url}/healthz", ctx, controller)
        issued = sh(str(BIN / "spotguard"), "controller", "--issue-token", JOB)
        token = issued.stdout.strip()
        report["token"] = token
        report["jobs"] = admin_get(f"{url}/v1/jobs", ctx)

        # --- the job's first VM (step 4): the launch template's user-data ---
        report["user_data"] = first_boot(work, paths, keys, url, token, tls=tls)
        report["systemctl"] = (work / "systemctl.calls").read_text().splitlines()
        report["token_file"] = Path(paths["token_path"]).read_text().strip()
        report["agent_config"] = Path(paths["config_path"]).read_text()
        if cloud != "aws":
            return report
        sim_port = free_port()
        sim = subprocess.Popen(
            [str(BIN / "spotguard"), "metadata-sim", "--clouds", "aws", "--port", str(sim_port),
             "--instance-type", "g6.xlarge"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        sim_url = f"http://127.0.0.1:{sim_port}"
        wait_http(f"{sim_url}/latest/meta-data/instance-id", None, sim)
        agent = start_agent(work, sim_url, endpoint)
        report["status"] = wait_status(agent)
        sh(str(BIN / "spotguard"), "notice", "--sim", sim_url, "send", "--cloud", "aws",
           "--kind", "rebalance")  # fmt: skip
        job: dict[str, Any] = {}
        for _ in range(600):  # up to 2 minutes on a loaded host
            try:
                job = admin_get(f"{url}/v1/jobs/{JOB}", ctx)
            except OSError:
                job = {}
            if job.get("image_url") or agent.poll() is not None:
                break
            time.sleep(0.2)
        report["job"] = job
    finally:
        report["controller_log"] = Path("/run/controller.log").read_text()[-20000:]
        if Path("/run/agent.log").exists():
            report["agent_log"] = Path("/run/agent.log").read_text()[-20000:]
    return report


if __name__ == "__main__":
    out = Path(sys.argv[1])
    try:
        result = main(out, sys.argv[2], *sys.argv[3:4])
    except Exception as exc:  # noqa: BLE001 - the report says what failed; the test shows it
        import traceback

        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        for name in ("controller", "agent"):
            log = Path(f"/run/{name}.log")
            if log.exists():
                result[f"{name}_log"] = log.read_text()[-20000:]
        if isinstance(exc, subprocess.CalledProcessError):
            result["stderr"] = exc.stderr
    (out / "report.json").write_text(json.dumps(result, indent=2))
