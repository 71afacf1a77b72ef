"""The data races Pallas' Mosaic GPU interpreter finds in every kernel a call runs.

The interpreter (``interpret=plgpu.InterpretGPUParams(detect_races=True)``) starts a
fresh race record for each kernel it runs, and ``gpu_callbacks.get_races()`` returns
the latest: after an op that runs several kernels (an MLA decode and the merge of its
pieces; the routing's sort and its schedules) it shows the last kernel's alone.
:func:`keep_race_records` keeps every record a test's kernels make.
"""

from __future__ import annotations

from unittest import mock

from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks


class RaceRecords:
  """The race records of the interpreted kernels run since the last :meth:`races_found`."""

  def __init__(self):
    self._records: list = []

  def add(self, record) -> None:
    self._records.append(record)

  def races_found(self) -> bool:
    """Whether any kernel run since the last call found a race; fails the test (an
    AssertionError) where no interpreted Mosaic GPU kernel ran since, so that a check
    never passes on nothing."""
    records, self._records = self._records, []
    if not records:
      raise AssertionError("no interpreted Mosaic GPU kernel ran since the last race check")
    return any(r.races_found for r in records)


def keep_race_records(test) -> RaceRecords:
  """Keeps the race record of every kernel interpreted during ``test`` (undone by the
  test's cleanup); returns them."""
  records = RaceRecords()
  new_record = gpu_callbacks.GPURaceDetectionState

  def kept(*args, **kwargs):
    record = new_record(*args, **kwargs)
    records.add(record)
    return record

  patcher = mock.patch.object(gpu_callbacks, "GPURaceDetectionState", kept)
  patcher.start()
  test.addCleanup(patcher.stop)
  return records
