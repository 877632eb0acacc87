"""``kvswitch worker`` whose model step raises on a chosen token: a real worker process with a
real failure inside its engine core. Run as ``python tests/faulty_worker.py worker ARGS``.

- ``KVSWITCH_TEST_FAIL_ON_TOKEN``: a token id; a step that computes it raises before the forward
  pass, so none of the KV the step was to write is written.
- ``KVSWITCH_TEST_FAIL_TIMES``: how many such steps fail (default 1); later ones run.

The engine core process is started with multiprocessing's spawn, which imports this file again
there (as ``__mp_main__``): that is where the failure is put in.
"""

from __future__ import annotations

import os
import sys

from kvswitch.app.cli import main
from kvswitch.worker.model_runner import ModelRunner


def make_steps_fail() -> None:
    token = int(os.environ["KVSWITCH_TEST_FAIL_ON_TOKEN"])
    num_left = [int(os.environ.get("KVSWITCH_TEST_FAIL_TIMES", "1"))]
    execute_batch = ModelRunner.execute_batch

    def failing_execute_batch(self, batch, *args, **kwargs):
        if num_left[0] > 0 and token in batch.input_ids:
            num_left[0] -= 1
            raise RuntimeError(f"injected failure on token {token}")
        return execute_batch(self, batch, *args, **kwargs)

    ModelRunner.execute_batch = failing_execute_batch


if __name__ == "__mp_main__":
    make_steps_fail()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
