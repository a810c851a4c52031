"""A torchrun demo's rank ends cleanly: leave_process_group ends every group's backend threads
while the interpreter is whole (course_lib.runtime.launch), so none of them can need the GIL
during Python's shutdown (where Python 3.11 ends such a thread inside C++: SIGABRT with
"terminate called without an active exception", or a hang)."""

import os
import subprocess
import sys
import textwrap

import pytest

RANK_SCRIPT = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

    def runloops():  # gloo's worker threads: two per process group here
        return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"
                   for t in os.listdir("/proc/self/task"))

    def rank(r, port, out_dir):
        from course_lib.runtime.device import rank_device
        from course_lib.runtime.launch import init_from_env, leave_process_group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                          LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2")
        init_from_env(timeout_s=120)
        alone = runloops()
        class Model:  # keeps its sub-group in a reference cycle, as modules with hooks do
            pass
        m = Model(); m.me = m; m.group = dist.new_group([0, 1])
        w = dist.all_reduce(torch.ones(4, device=rank_device()), group=m.group, async_op=True)
        w.wait()
        with_sub = runloops()
        del m, w
        try:
            pass
        finally:
            leave_process_group()
        with open(os.path.join(out_dir, f"rank{r}"), "w") as f:  # a file each: prints interleave
            f.write(f"{alone} {with_sub} {runloops()}")

    if __name__ == "__main__":
        mp.spawn(rank, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
''')


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_leave_process_group_ends_the_backend_threads_of_groups_held_in_cycles(tmp_path):
    from course_lib.runtime.pool import free_port

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(free_port()), str(tmp_path)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        line = (tmp_path / f"rank{r}").read_text()
        alone, with_sub, after = map(int, line.split())
        assert with_sub > alone  # the sub-group's threads existed
        # and are gone once the rank has left (without the collection: still with_sub)
        assert after <= alone, line
