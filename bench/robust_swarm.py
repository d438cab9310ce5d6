"""Benchmark: robust aggregation in a real swarm, issue 10 §3. Three honest `adloco-node` processes
(`--honest`) and a fourth node (real p2pd, loopback, tiny-llama; `--model gpt2-124m`: GPT-2 124M with
bench/memory.py's flags) train `--rounds` rounds; in the clean runs the
fourth is honest too, in the others it is bench/hostile_node.py sending a forged pseudo-gradient
every round (the simulator's attacks: flip1000 = −1000 Δ, flip = −Δ claiming the most weight the
round allows, random = noise at Δ's norm, constant = one noise direction every round), or lying as
an owner (owner-scaled, owner-noise, owner-split, owner-stall, owner-omit, owner-rewrite,
owner-header, owner-refuse), withholding its reveal (mute) or its parts (silent: it joins groups and sends no
owner anything), or sending an honest Δ with a forged claim (claim: 10^12 tokens), payload (sum-bomb)
or report (report), dating its readiness records 30 s back (backdate), or serving laggards a
far-ahead state (hijack: it trains nothing) or poisoned kept updates (replay-poison); `+rekey`
after any of them: left out, it joins again under a fresh key; `+fresh`: after every round it
averaged in (`+freshN`: every N rounds), it joins again under a fresh key (a newcomer in every
group it is in).
`--fourth-at K` starts the fourth node (in every run, the clean one too) only once the first applied
K rounds: a stranger's key joining a running swarm, where the honest nodes have records and it has
none, instead of a founder's. `--join-at K` starts an honest fifth node once the first applied K
rounds: it catches up from the holders of the head (the fourth node among them) and trains on; its
seconds to its first round on the honest θ, any round it applied on another θ, and how it caught up
are recorded. Every combination of `--rules` (the owners' `--aggregate`; "default": the flag left
out, so a public run's default applies; the trimmed mean is refused in a public run, as every run
here is), `--scores` (every node's `--score`: owners judge each member's Δ over their parts by the
loss on their own data) and `--attacks` runs once per seed, after a discarded clean warm-up run
(`--warmup-rounds`).
Printed and written to bench/results/robust_swarm.json: the honest nodes' final val loss
(median of the three), and its gap against the clean run under the same rule and under the mean;
the wall time's gap against the clean run; in_clean_time (issue 25 §2's measure, as bench/liveness.py
takes it in the simulator): the share of the rounds the first honest node had applied by the time
at which, in the clean run of the same rule and seed, it applied its last; in_clean_tokens: the
same counted in the tokens that node had trained (rounds differ in work where the batch test grows b
differently from run to run; tokens do not); theta_agree: every
round all three honest nodes applied holds one θ on all three (a node that
caught up over a round has no record of it; one that went on alone after the others stopped has
rounds of its own past theirs). A rule with scoring on is labelled `rule+score`.

    python bench/robust_swarm.py                       # 2 rules x 5 runs, ~10 min on 2 cores
    python bench/robust_swarm.py --rules mean clip:1 --attacks none flip --rounds 8
    python bench/robust_swarm.py --rules mean --scores loss --out bench/results/robust_swarm_score.json
    python bench/robust_swarm.py --rules default --attacks none hijack replay-poison --join-at 4
    python bench/robust_swarm.py --summarize bench/results/robust_swarm_liveness_founder.json
    python bench/robust_swarm.py --model gpt2-124m --honest 2 --attacks none owner-scaled --rounds 4
    python bench/robust_swarm.py --rules default --attacks none mute+rekey --rounds 40 \
        --node-arg=--batch-test --node-arg=none      # every round the same work (no batch test)
The medians over the seeds close the output (and the JSON's "medians"); `--summarize` prints them
for results written before.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memory import GPT2_124M, TRAIN_ARGS, make_tokenizer
from swarm import NET, Node, _events, _finish, _wait

RESULTS = Path(__file__).resolve().parent / "results" / "robust_swarm.json"
TRAIN = [
    *("--inner-steps", "3", "--seq-len", "64", "--batch-size", "4", "--max-corpus-mb", "2"),
    *("--threads", "1", "--window-s", "2", "--data-shards", "4"),
]
# GPT-2 124M (`--model gpt2-124m`): the memory and swarm benchmarks' settings, a config and tokenizer
# of its vocabulary written into each run's folder.
TRAIN_124M = [*TRAIN_ARGS, "--max-corpus-mb", "2", "--threads", "1", "--window-s", "2", "--data-shards", "4"]
HOSTILE = str(Path(__file__).resolve().parent / "hostile_node.py")


def one_run(
    work: Path,
    *,
    rule: str,
    score: str,
    attack: str,
    rounds: int,
    seed: int,
    join_at: int = 0,
    fourth_at: int = 0,
    honest: int = 3,
    model: str = "tiny-llama",
    node_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    train = [*TRAIN, *node_args]
    if model == "gpt2-124m":  # made before the clock starts
        config = work / "gpt2-124m.json"
        config.write_text(json.dumps(GPT2_124M))
        train = [*TRAIN_124M, "--model", str(config), "--tokenizer", str(make_tokenizer(work)), *node_args]
    t0 = time.monotonic()
    maddrs = work / "bootstrap.json"
    boot = ["adloco-bootstrap", "--identity-path", str(work / "b.key"), *NET[:3]]
    boot += ["--maddrs-file", str(maddrs)]
    bootstrap = Node("bootstrap", boot, work, status=False)
    nodes: list[Node] = []
    try:
        _wait("bootstrap", maddrs.exists, 120, [bootstrap])
        peers = json.loads(maddrs.read_text())
        common = ["--peers", *peers, "--run-id", f"robust-{seed}", "--seed", str(seed), "--score", score]
        common += [] if rule == "default" else ["--aggregate", rule]
        for i in range(honest + 1):
            if i == honest and fourth_at:
                # A stranger joining a running swarm, not one of its founders: the honest three have
                # worked together (records) by then, the fourth's key has none.
                _wait("the fourth node's start", lambda: len(nodes[0].rounds()) >= fourth_at, 600, nodes)
            hostile = attack != "none" and i == honest
            program = ["python", HOSTILE, "--attack", attack] if hostile else ["adloco-node"]
            # The fourth node runs until stopped: it is there for every honest round.
            planned = "0" if i == honest else str(rounds)
            cmd = [*program, *common, "--rounds", planned, "--data-shard", str(i), *train, *NET]
            nodes.append(Node(f"n{i}", cmd, work))
        if join_at:
            # An honest joiner, once the first node applied `join_at` rounds: it catches up from
            # the holders (the hostile node among them) and trains on until stopped.
            _wait("the join", lambda: len(nodes[0].rounds()) >= join_at, 600, nodes)
            cmd = ["adloco-node", *common, "--rounds", "0", "--data-shard", "0", *train, *NET]
            nodes.append(Node("joiner", cmd, work))
        _finish(nodes[:honest], work, "honest nodes")
    finally:
        for node in [*nodes, bootstrap]:
            node.kill()
    wall_s = time.monotonic() - t0
    finals = [n.rounds()[-1] for n in nodes[:honest]]
    groups = [e["group_size"] for e in nodes[0].rounds()]
    # θ per round each honest node reached by applying it (a node that caught up over a round, or
    # went on alone after the others had applied their --rounds, has no record of it, or its own).
    reached = [{e["round"]: e["theta_hash"] for e in n.rounds()} for n in nodes[:honest]]
    shared = set.intersection(*(set(r) for r in reached))
    joined = _joiner(nodes[honest + 1], reached, work, hostile=nodes[honest].name) if join_at else {}
    return {
        **joined,
        "wall_s": round(wall_s, 1),
        "dropped": statistics.median(f.get("dropped", 0) for f in finals),  # Δs of honest nodes never applied
        "rule": rule if score == "off" else f"{rule}+{score}",
        "attack": attack,
        "seed": seed,
        "rounds": [f["round"] for f in finals],
        "applied": [len(r) for r in reached],
        "val_loss": statistics.median(f["val_loss"] for f in finals),
        # Every byte an honest node sent (the median node), and of those the checks' statements.
        "mb_sent": round(statistics.median(f["bytes_sent"] for f in finals) / 1e6, 3),
        "checks_mb_sent": round(statistics.median(f.get("checks_sent", 0) for f in finals) / 1e6, 3),
        # Every round all three applied holds one θ on all three (the rounds one of them caught up
        # over, it took from the others: checked against their hash when it did).
        "theta_agree": all(len({r[k] for r in reached}) == 1 for k in shared),
        "rounds_all_applied": len(shared),
        "rounds_of_4": sum(1 for g in groups if g == honest + 1),  # rounds of every node (4 by default)
        "rejected_parts": nodes[0].rounds()[-1].get("rejected_parts", 0),  # cumulative: the last round's
        "group_sizes": groups,
        # When the first honest node applied each round, seconds after it started: how many rounds an
        # attacked run completes in the clean run's time (`_in_clean_time`).
        "round_at_s": [round(e["time"] - nodes[0].started, 2) for e in nodes[0].rounds()],
        # The first honest node's batch (summed over its instances) in its last round: AdLoCo's batch
        # test grows it by what the gradients' noise shows, which differs from run to run, so two runs'
        # rounds are not equal work where it differs (`--node-arg=--batch-test --node-arg=none`).
        "batch_final": sum(nodes[0].rounds()[-1].get("batch_sizes", [])),
        # The tokens the first honest node had trained when it applied each round (`in_clean_tokens`).
        "tokens_at": [e["tokens_total"] for e in nodes[0].rounds()],
        "rejected_by_round": [e.get("rejected_parts", 0) for e in nodes[0].rounds()],  # cumulative
    }


def _joiner(joiner: Node, reached: list[dict[int, str]], work: Path, *, hostile: str) -> dict[str, Any]:
    """How the joiner did: seconds from its start to its first round on the honest nodes' θ, rounds
    it applied on another θ than theirs, how it caught up, and how often the hostile node served
    poisoned updates (replay-poison)."""
    honest: dict[int, str] = {}
    for r in reached:
        honest.update(r)
    events = _events(joiner.status)
    rounds = [e for e in events if e["event"] == "round"]
    agreed = next((e for e in rounds if honest.get(e["round"]) == e["theta_hash"]), None)
    hostile_log = work / f"{hostile}.log"
    served = hostile_log.read_text().count("poisoned updates") if hostile_log.exists() else 0
    return {
        "joiner_agree_s": None if agreed is None else round(agreed["time"] - joiner.started, 1),
        "joiner_rounds": len(rounds),
        "joiner_foreign": sum(
            1 for e in rounds if e["round"] in honest and honest[e["round"]] != e["theta_hash"]
        ),
        "joiner_catch_ups": [e["how"] for e in events if e["event"] in ("catch_up", "fork_healed")],
        "poisoned_served": served,
    }


def _in_clean_time(run: dict[str, Any], clean: dict[str, Any] | None) -> float | None:
    """Issue 25 §2's measure (as `bench/liveness.py` takes it in the simulator): the share of the
    run's rounds the first honest node had applied by the time, from its start, at which it applied
    its last round in the clean run of the same rule and seed."""
    if clean is None or not clean.get("round_at_s") or not run.get("round_at_s"):
        return None
    end = clean["round_at_s"][-1]
    return sum(1 for t in run["round_at_s"] if t <= end) / len(clean["round_at_s"])


def _in_clean_tokens(run: dict[str, Any], clean: dict[str, Any] | None) -> float | None:
    """`_in_clean_time` counted in work, not rounds: the tokens the first honest node had trained
    into the rounds it applied by the clean run's end (from its start), over the clean run's. Rounds
    are not equal work where the batch test grows b differently from run to run; tokens are."""
    if clean is None or not clean.get("tokens_at") or not run.get("tokens_at"):
        return None
    end = clean["round_at_s"][-1]
    done = [tok for t, tok in zip(run["round_at_s"], run["tokens_at"], strict=True) if t <= end]
    return (done[-1] if done else 0) / clean["tokens_at"][-1]


def _gap(value: float, base: float | None) -> str:
    return "" if base is None else f"{100 * (value / base - 1):+.1f} %"


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rule and attack, over the seeds: the median share of rounds in the clean time (and the
    lowest), the median gaps of wall time and val loss against the clean run of the same seed, the
    most Δs an honest node dropped in one run, and whether θ agreed in every run."""
    clean = {(r["rule"], r["seed"]): r for r in runs if r["attack"] == "none"}
    table: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        table.setdefault((r["rule"], r["attack"]), []).append(r)
    rows = []
    for (rule, attack), same in table.items():
        pairs = [(r, clean[rule, r["seed"]]) for r in same if (rule, r["seed"]) in clean]
        shares = [s for s in (_in_clean_time(r, b) for r, b in pairs) if s is not None]
        work = [s for s in (_in_clean_tokens(r, b) for r, b in pairs) if s is not None]
        rows.append(
            {
                "rule": rule,
                "attack": attack,
                "seeds": sorted(r["seed"] for r in same),
                "in_clean_time": statistics.median(shares) if shares else None,
                "in_clean_time_min": min(shares) if shares else None,
                "in_clean_tokens": statistics.median(work) if work else None,
                "in_clean_tokens_min": min(work) if work else None,
                "wall_gap": _median_gap(pairs, "wall_s"),
                "val_gap": _median_gap(pairs, "val_loss"),
                "dropped_max": max(r["dropped"] for r in same),
                "theta_agree": all(r["theta_agree"] for r in same),
            }
        )
        agreed = [r["joiner_agree_s"] for r in same if r.get("joiner_agree_s") is not None]
        if any("joiner_rounds" in r for r in same):  # a run with a joiner (`--join-at`)
            rows[-1]["joiner_agree_s"] = statistics.median(agreed) if agreed else None
            rows[-1]["joiner_never_agreed"] = len(same) - len(agreed)
            rows[-1]["joiner_foreign"] = sum(r["joiner_foreign"] for r in same)
    return rows


def _median_gap(pairs: list[tuple[dict[str, Any], dict[str, Any]]], key: str) -> float | None:
    return statistics.median(r[key] / base[key] - 1 for r, base in pairs) if pairs else None


def print_medians(rows: list[dict[str, Any]]) -> None:
    def pct(v: float | None, sign: str = "") -> str:
        return "" if v is None else f"{100 * v:{sign}.1f} %"

    print(
        f"\n{'rule':<14} {'attack':<18} {'seeds':>5} {'in clean time':>14} {'lowest':>8}"
        f" {'tokens':>8} {'lowest':>8} {'wall vs clean':>14} {'val vs clean':>13}"
        f" {'dropped':>8} {'θ agreed':>9}"
    )
    for m in rows:
        print(
            f"{m['rule']:<14} {m['attack']:<18} {len(m['seeds']):>5} {pct(m['in_clean_time']):>14}"
            f" {pct(m['in_clean_time_min']):>8} {pct(m.get('in_clean_tokens')):>8}"
            f" {pct(m.get('in_clean_tokens_min')):>8} {pct(m['wall_gap'], '+'):>14}"
            f" {pct(m['val_gap'], '+'):>13}"
            f" {m['dropped_max']:>8} {'yes' if m['theta_agree'] else 'NO':>9}"
            + (
                f"  joiner: on the honest θ after {m['joiner_agree_s']} s (median), never in"
                f" {m['joiner_never_agreed']}, {m['joiner_foreign']} rounds on another θ"
                if "joiner_foreign" in m
                else ""
            )
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rules", nargs="+", default=["default", "mean"])
    p.add_argument("--scores", nargs="+", default=["off"])
    p.add_argument("--attacks", nargs="+", default=["none", "flip1000", "flip", "random", "constant"])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--join-at", type=int, default=0, help="start an honest joiner after this round (0: none)")
    p.add_argument(
        "--fourth-at",
        type=int,
        default=0,
        help="start the fourth node (hostile or, in the clean run, honest) once the first applied this"
        " many rounds (0: with the others, a founder of the swarm)",
    )
    p.add_argument("--honest", type=int, default=3, help="honest nodes beside the fourth (hostile) one")
    p.add_argument(
        "--model",
        choices=("tiny-llama", "gpt2-124m"),
        default="tiny-llama",
        help="gpt2-124m: the GPT-2 124M config with bench/memory.py's flags (~5 GB a node)",
    )
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every node, hostile or not (repeat; --node-arg=--batch-test)",
    )
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=3,
        help="a clean run of this many rounds first, discarded: the first run of a pass starts cold"
        " (bytecode, page cache), which made its clean run slower than the attacked ones (0: none)",
    )
    p.add_argument("--keep", action="store_true", help="keep every run's logs (a fork's are kept anyway)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: print the medians over seeds of results written before, one table a file",
    )
    args = p.parse_args()
    if args.summarize:
        for path in args.summarize:
            try:
                runs = json.loads(path.read_text())["runs"]
            except (OSError, ValueError, KeyError) as e:
                raise SystemExit(f"--summarize: {path}: not a robust_swarm result ({e})") from None
            print(f"{path}:", end="")
            print_medians(medians(runs))
        return
    runs = []
    t0 = time.time()
    if args.warmup_rounds:
        work = Path(tempfile.mkdtemp(prefix="adloco-robust-"))
        warm = one_run(
            work,
            rule=args.rules[0],
            score=args.scores[0],
            attack="none",
            rounds=args.warmup_rounds,
            seed=args.seeds[0],
            honest=args.honest,
            model=args.model,
            node_args=tuple(args.node_arg),
        )
        shutil.rmtree(work)
        print(
            f"warm-up: a clean run of {args.warmup_rounds} rounds in {warm['wall_s']} s, discarded",
            flush=True,
        )
    for seed in args.seeds:
        for rule, score in [(r, sc) for r in args.rules for sc in args.scores]:
            for attack in args.attacks:
                work = Path(tempfile.mkdtemp(prefix="adloco-robust-"))
                run = one_run(
                    work,
                    rule=rule,
                    score=score,
                    attack=attack,
                    rounds=args.rounds,
                    seed=seed,
                    join_at=args.join_at,
                    fourth_at=args.fourth_at,
                    honest=args.honest,
                    model=args.model,
                    node_args=tuple(args.node_arg),
                )
                if args.keep:
                    run["logs"] = str(work)
                elif run["theta_agree"]:
                    shutil.rmtree(work)
                else:  # a fork is a bug report: every node's log stays for it
                    run["logs"] = str(work)
                    print(f"θ disagreed: the nodes' logs are in {work}", file=sys.stderr)
                runs.append(run)
                print(json.dumps(run), flush=True)
    clean = {(r["rule"], r["seed"]): r for r in runs if r["attack"] == "none"}
    for r in runs:
        r["in_clean_time"] = _in_clean_time(r, clean.get((r["rule"], r["seed"])))
    print(
        f"\n{'rule':<14} {'attack':<13} {'seed':>4} {'val loss':>9} {'vs clean, same rule':>20}"
        f" {'vs clean mean':>14} {'wall vs clean':>14} {'rounds in clean time':>21}"
    )
    for r in runs:
        base = clean.get((r["rule"], r["seed"]))
        same = _gap(r["val_loss"], base and base["val_loss"])
        mean = _gap(
            r["val_loss"], clean[("mean", r["seed"])]["val_loss"] if ("mean", r["seed"]) in clean else None
        )
        wall = _gap(r["wall_s"], base and base["wall_s"])
        share = "" if r["in_clean_time"] is None else f"{r['in_clean_time']:.0%}"
        print(
            f"{r['rule']:<14} {r['attack']:<13} {r['seed']:>4} {r['val_loss']:>9.4f} {same:>20} {mean:>14}"
            f" {wall:>14} {share:>21}"
        )
    table = medians(runs)
    print_medians(table)
    payload = {
        "medians": table,
        "setup": {
            "nodes": args.honest + 1,
            "hostile": 1,
            "rounds": args.rounds,
            "join_at": args.join_at,
            "fourth_at": args.fourth_at,
            "model": args.model,
            "train": TRAIN if args.model == "tiny-llama" else TRAIN_124M,
        },
        "seconds": round(time.time() - t0, 1),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out} ({payload['seconds']} s)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
