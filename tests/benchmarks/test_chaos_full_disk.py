"""The chaos soak's full disk (benchmarks/chaos.py, `disk`): it aims at the next save before the final one, through
the trainer's fault hook file, and removes the file once the run is past that save."""

from __future__ import annotations

from benchmarks.chaos import fill_disk


class Running:
    """A daemon process that has not exited."""

    returncode = None

    def poll(self):
        return None


class Api:
    """The run's status: past step 7; what the fault's file said while the chaos waited."""

    def __init__(self, marker):
        self.marker, self.seen = marker, []

    def status(self):
        self.seen.append(self.marker.read_text())
        return {"progress": {"step": 7}}


def test_the_full_disk_aims_at_the_next_save_and_is_lifted_once_the_run_is_past_it(tmp_path):
    marker, checkpoints = tmp_path / "full_disk", tmp_path / "checkpoints"
    (checkpoints / "global_step_8").mkdir(parents=True)  # the later save the run made
    api = Api(marker)
    event = fill_disk(api, Running(), checkpoints, marker, step=5, save_freq=2, steps=12, where="rename")
    assert api.seen == ["rename@6"]  # step 6's save, the next after step 5
    assert event == {"full_disk_at_step": 6, "where": "rename", "recovered": True,
                     "recovery_s": event["recovery_s"], "partial_left": []}
    assert not marker.exists()


def test_no_full_disk_when_the_next_save_is_the_final_one(tmp_path):
    marker = tmp_path / "full_disk"
    event = fill_disk(Api(marker), Running(), tmp_path, marker, step=10, save_freq=2, steps=12, where="write")
    assert event == {"skipped": "no save left before the final one"} and not marker.exists()
