"""The diloco demo's --kill-replica K --at-step S: DiLoCo with a replica killed for real.

    torchrun --nproc-per-node=2 -m course_lib.demos.diloco --replicas 3 --inner-steps 2 \\
             --kill-replica 1 --at-step 3 --check

The design, plainly. torchrun's agent ends the whole job when one of its workers dies, so the
killed replica cannot be a torchrun worker. Here the torchrun ranks host the replicas instead
(course_lib.parallel.ft.run_ft_hosted): rank 0 serves the quorum's store, and the R replica
processes, plus one spare that plays the restarted replica, are children of the ranks (process
r on rank r % N), joined in a gloo world of their own. Each replica is one process training the
fault-tolerant runs' tiny MLP (course_lib.parallel.ft; not the course GPT, and not N / R ranks
per replica) with DiLoCo (parallel.ft.local): H inner AdamW steps alone, then a quorum over the
store and the outer Nesterov step on the deltas of the quorum's replicas. Replica K's process
SIGKILLs itself at the start of step S; the others never stop, and their next sync averages over
the survivors. Unless --no-rejoin, the spare joins at the second sync after the kill
(--rejoin-step T to choose, a multiple of H) and is healed from a healthy peer: parameters,
AdamW state, the outer copy and its momentum, in one send.

Rank 0 prints each step's loss per replica, each sync's quorum, the killed process's exit status
and the healing. --check replays the same data and the same quorum sequence in one process
(parallel.ft.replay_diloco) and exits 1 when a loss differs by more than adamw_loss_atol(lr), a
replica's final parameters by more than param_rms_tolerance in RMS (the reasons are there), the
healed state is not the sent one bit for bit, the survivors disagree on a quorum, or the killed
process did not end by the signal.
"""

from __future__ import annotations

from dataclasses import replace

from course_lib.parallel.diloco.simulate import param_rms_tolerance
from course_lib.parallel.ft import FtConfig, check_ft, replay_diloco, run_ft_hosted
from course_lib.platform import HARD_KILL
from course_lib.tolerances import adamw_loss_atol

CONFLICTS = ("ddp", "local_sgd", "bf16_outer", "shard", "slow_rank")
TIMEOUT_S = 120  # the replicas' whole run; a run takes seconds (3 s of it the quorum's wait for the dead)


def add_flags(p) -> None:
    p.add_argument("--kill-replica", type=int, default=None, help="K: this replica's process is SIGKILLed ...")
    p.add_argument("--at-step", type=int, default=None, help="... at the start of step S")
    p.add_argument("--rejoin-step", type=int, default=None,
                   help="the restarted replica joins at this sync (default: the second sync after the kill)")
    p.add_argument("--no-rejoin", action="store_true", help="the killed replica never comes back")


def wanted(args) -> bool:
    """Whether the run is a kill run; a flag of it without --kill-replica is refused (build_ft)."""
    return (args.kill_replica is not None or args.at_step is not None or args.rejoin_step is not None
            or args.no_rejoin)


def build_ft(args) -> FtConfig:
    """The run's FtConfig, every rule checked here (ValueError naming the flag, its value and the rule)."""
    if args.kill_replica is None:
        raise ValueError("--at-step, --rejoin-step and --no-rejoin need --kill-replica K: which replica dies")
    if args.at_step is None:
        raise ValueError(f"--kill-replica={args.kill_replica} needs --at-step S: the step whose start it dies at")
    used = [f"--{name.replace('_', '-')}" for name in CONFLICTS if getattr(args, name) not in (None, False)]
    if used or args.streaming != 1:
        raise ValueError(f"--kill-replica runs DiLoCo on fault-tolerant replicas of one process each: not with "
                         f"{', '.join(used + (['--streaming'] if args.streaming != 1 else []))}")
    r, h, steps = args.replicas, args.inner_steps, args.steps
    if not (isinstance(r, int) and r >= 2):
        raise ValueError(f"--replicas={r} must be >= 2 with --kill-replica: someone must survive")
    if not 0 <= args.kill_replica < r:
        raise ValueError(f"--kill-replica={args.kill_replica} is not a replica: replicas are 0..{r - 1}")
    if not 1 <= args.at_step <= steps:
        raise ValueError(f"--at-step={args.at_step} must be in 1..--steps={steps}: the kill happens at the start "
                         f"of a step of the run")
    if args.no_rejoin and args.rejoin_step is not None:
        raise ValueError(f"--rejoin-step={args.rejoin_step} with --no-rejoin: choose one")
    rejoin = args.rejoin_step
    if rejoin is None and not args.no_rejoin and isinstance(h, int) and h >= 1:
        second = -(-args.at_step // h) * h + h  # the first sync at or after S is the one that excludes K
        rejoin = second if second <= steps else None
    cfg = FtConfig(replicas=r, steps=steps, lr=args.lr, algorithm="diloco", inner_steps=h, outer_lr=args.outer_lr,
                   outer_momentum=args.outer_momentum, kill_slot=args.kill_replica, kill_step=args.at_step,
                   rejoin_step=rejoin)
    check_ft(cfg)
    return cfg


def run(cfg: FtConfig):
    """Rank code: the replicas hosted by the ranks; the FtRun on rank 0."""
    return run_ft_hosted(cfg, timeout_s=TIMEOUT_S)


def report(run, cfg: FtConfig, world: int, check: bool) -> int:
    """Rank 0: the losses, quorums, the kill and the healing; with check the verdict (0 or 1)."""
    k, h = cfg.kill_slot, cfg.inner_steps
    back = f", restarted and joining at step {cfg.rejoin_step}" if cfg.rejoin_step else ", never restarted"
    print(f"DiLoCo with a failure: {cfg.replicas} replicas of one process each (hosted by {world} rank(s)), "
          f"H = {h}; replica {k} killed at the start of step {cfg.kill_step}{back}", flush=True)
    done = [x for x in run.results if x is not None]
    owner = {}  # (step, slot) -> the process's result that trained it
    for x in done:
        for t in x.losses:
            owner[(t, x.slot)] = x
    survivors = [x for x in done if x.rank == x.slot]
    quorums = {t: sorted(q) for t, q in survivors[0].quorums.items()}
    agree = all({t: sorted(q) for t, q in x.quorums.items()} == quorums for x in survivors)
    print(f"{'step':>4} " + " ".join(f"{'replica ' + str(s):>10}" for s in range(cfg.replicas)) + "  sync quorum")
    for t in range(1, cfg.steps + 1):
        cells = [f"{owner[(t, s)].losses[t]:>10.5f}" if (t, s) in owner else f"{'-':>10}" for s in range(cfg.replicas)]
        print(f"{t:>4} " + " ".join(cells) + (f"  {quorums[t]}" if t in quorums else ""))
    print("(-: no loss to show: the replica was dead, or its process died with its losses)")
    killed = run.exitcodes[k] == -HARD_KILL and run.results[k] is None
    print(f"replica {k}'s process: exit status {run.exitcodes[k]}"
          + (" (SIGKILL): killed for real" if killed else ": NOT killed by the signal"))
    healed = True
    for joiner in (x for x in done if x.received):
        for t, got in joiner.received.items():
            sender = next(x for x in done if t in x.sent)
            same = bool((got == sender.sent[t]).all()) and got.numel() == sender.sent[t].numel()
            healed &= same
            print(f"step {t}: replica {joiner.slot} (a new process) received {got.numel()} floats from replica "
                  f"{sender.slot}: {'equal to what was sent, bit for bit' if same else 'NOT what was sent'}")
    if not check:
        return 0
    ref = replay_diloco(cfg, quorums)
    loss_tol, param_tol = adamw_loss_atol(cfg.lr), param_rms_tolerance(cfg.lr, h, cfg.outer_lr, cfg.outer_momentum)
    worst_loss = max(abs(x.losses[t] - ref["losses"][t][x.slot]) for x in done for t in x.losses)
    ends = [x for x in done if x.slot in ref["replica_params"]]
    worst = max(float((x.final_params - ref["replica_params"][x.slot]).double().pow(2).mean().sqrt()) for x in ends)
    loss_ok, params_ok = worst_loss <= loss_tol, worst <= param_tol  # False for a NaN
    never = replace(cfg, kill_slot=None, kill_step=None, rejoin_step=None)  # the run without the failure
    full = replay_diloco(never, {t: list(range(cfg.replicas)) for t in quorums})
    moved = float((full["final_params"] - ref["final_params"]).abs().max())
    print(f"against the one-process replay of the same data and quorums: losses {worst_loss:.2e} (tolerance "
          f"{loss_tol:.1e}): {'OK' if loss_ok else 'MISMATCH'}; parameters {worst:.2e} RMS (tolerance "
          f"{param_tol:.1e}): {'OK' if params_ok else 'MISMATCH'}")
    print(f"survivors agree on every quorum: {'OK' if agree else 'MISMATCH'}; a run that never failed ends "
          f"{moved:.2e} away (largest element): the outage (lost inner steps, smaller syncs)", flush=True)
    return 0 if loss_ok and params_ok and agree and killed and healed else 1
