"""The trainer that the kill loop kills: resumes from the newest step, then trains and calls
``save_async`` every step until it is killed.

Run as ``python -m faults._trainer ROOT MODE OPTIONS_JSON STEPS`` (the kill loop forks it from a
zygote with torch already imported). It tells the driver what it does, one line each, flushed:

- ``ready START PID``: constructed and resumed (START is the first step it will train);
- ``saving S`` / ``queued S``: around ``save_async(S)``;
- ``committed S``: the manager reported S committed (``on_save_end``);
- ``failed S TYPE``: ``save_async`` raised our error for an earlier save (a killed writer);
- ``done``: it ran out of steps (the driver asks for more than it will need).
"""

from __future__ import annotations

import json
import os
import sys
import threading

_OUT = threading.Lock()


def say(*words: object) -> None:
    line = " ".join(str(w) for w in words) + "\n"
    with _OUT:  # the save thread reports commits while the main thread reports saves
        sys.stdout.write(line)
        sys.stdout.flush()


def main(argv: list[str]) -> None:
    import ckptmgr
    from ckptmgr.errors import CkptmgrError
    from ckptmgr.events import CheckpointListener
    from faults._common import MAX_TO_KEEP, build, state, train_step

    root, mode, opts_json, steps = argv[0], argv[1], argv[2], int(argv[3])
    opts = json.loads(opts_json) or None

    class Report(CheckpointListener):
        def on_save_end(self, stats: object) -> None:
            say("committed", stats.step)  # type: ignore[attr-defined]

    mgr = ckptmgr.CheckpointManager(root, 1, MAX_TO_KEEP, chkpt_on_preemption=False,
                                    storage_options=opts, async_mode=mode)
    mgr.add_listener(Report())
    model, opt = build()
    start = 0
    latest = mgr.latest_step()
    if latest is not None:
        ckptmgr.prime_optimizer(opt)
        st = state(model, opt, latest)
        mgr.restore(latest, st)
        start = latest + 1
    if mode == "thread":
        # Half the lives (by the step they resume at) write while the state is still being
        # copied into staging (the default), half copy first (as process mode does), so kills
        # land in both.
        from ckptmgr import _save_path
        from ckptmgr.dcp import writer

        _save_path.OVERLAP_STAGING = start % 2 == 1
        # Half the lives, crossed with those, make the checksums on a thread of their own
        # (ckptmgr.dcp.writer.HASH_BEHIND, off by default), so kills land there too.
        writer.HASH_BEHIND = start % 4 >= 2
    say("ready", start, os.getpid())
    for step in range(start, start + steps):
        train_step(model, opt, step)
        say("saving", step)
        try:
            mgr.save_async(step, state(model, opt, step))
        except CkptmgrError as e:
            say("failed", step, type(e).__name__)
            continue
        say("queued", step)
    mgr.close()
    say("done")


if __name__ == "__main__":
    main(sys.argv[1:])
