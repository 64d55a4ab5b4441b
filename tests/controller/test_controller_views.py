"""``GET /v1/jobs/{job}`` shows every field of the job's record: :class:`JobView` repeats
:class:`~spotguard.controller.state.JobRecord`'s fields (the record is the controller's
dataclass, the view its wire model), and a field added to the record and not to the view
would be dropped from the answer without a word."""

from __future__ import annotations

import dataclasses

from spotguard.controller.state import JobRecord
from spotguard.controller.views import JobView


def test_the_job_view_carries_every_field_of_the_record() -> None:
    record = {f.name for f in dataclasses.fields(JobRecord)}
    missing = record - set(JobView.model_fields)
    assert not missing, f"JobView lacks JobRecord's {sorted(missing)}"
