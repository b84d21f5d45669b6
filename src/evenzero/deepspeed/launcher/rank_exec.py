"""One rank of a `deepspeed` launch: torchrun starts this file as each worker; it sets
what DeepSpeed's per-node launcher sets (deepspeed/launcher/launch.py@0.19.8) and then
execs the user's program in its place (same pid, so torchrun watches the program).

    python -u rank_exec.py SPEC_JSON PROGRAM ARGS...

SPEC_JSON (from `evenzero.deepspeed.launcher.runner.rank_spec`): how to start PROGRAM
(`python -u PROGRAM`, `python -u -m PROGRAM`, or PROGRAM itself), whether to pass
`--local_rank=R` before ARGS, the cores to bind the ranks to, and the OMP_NUM_THREADS the
user had (torchrun sets 1 when it was unset; DeepSpeed's launcher does not).

Standalone on purpose: it imports nothing from evenzero (or torch), so a rank starts fast.
"""

import json
import os
import sys


def bound_cores(cores, nlocal, local_rank):
    per = len(cores) // nlocal
    return per, cores[per * local_rank:per * (local_rank + 1)]


def program(spec, prog, args, local_rank):
    extra = [f"--local_rank={local_rank}"] if spec["local_rank_arg"] else []
    if spec["mode"] == "no_python":
        return [prog, *extra, *args]
    head = [sys.executable, "-u"] + (["-m"] if spec["mode"] == "module" else [])
    return [*head, prog, *extra, *args]


def main(argv):
    spec, prog, args = json.loads(argv[1]), argv[2], argv[3:]
    env = os.environ
    local_rank = int(env["LOCAL_RANK"])
    nlocal = int(env.get("LOCAL_WORLD_SIZE", "1"))
    env["LOCAL_SIZE"] = str(nlocal)
    env["CROSS_RANK"] = env.get("GROUP_RANK", "0")
    env["CROSS_SIZE"] = "1"
    if spec["omp_num_threads"] is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = spec["omp_num_threads"]
    cmd = program(spec, prog, args, local_rank)
    if spec["bind_cores"]:
        per, mine = bound_cores(spec["bind_cores"], nlocal, local_rank)
        env["OMP_NUM_THREADS"] = str(per)
        # DeepSpeed runs `numactl -C <cores> [-m <node>]`; the affinity is the same, and
        # memory lands on the cores' node by the kernel's first-touch policy.
        os.sched_setaffinity(0, mine)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main(sys.argv)
