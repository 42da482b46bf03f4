"""pollen and PFLlib side by side: the same personalised methods on the same clients' data.

    .venv/bin/python benchmarks/pfllib_side_by_side.py [--methods fedavg,local]
        [--rounds 10] [--repeats 3] [--frameworks pollen,pfllib] [--out bench-out/pfllib]
        [--pfllib ~/.cache/pollen-bench/PFLlib] [--pfllib-origin URL]
        [--pfllib-venv ~/.cache/pollen-bench/pfllib-venv] [-c "key=value ..."]

PFLlib (Zhang et al., JMLR 2025, https://github.com/TsingZ0/PFLlib) is run
from its own repository at `PFLLIB_COMMIT`, checked out into `--pfllib`
(cloned from `--pfllib-origin` where it is missing) and run by the Python
of an environment of its own, `--pfllib-venv`, made on first use with uv:
torch and torchvision pinned to pollen's, and the packages its `main.py`
imports. Nothing of PFLlib's is copied into pollen.

The workload is PFLlib's practical scenario as pollen partitions it:
Fashion-MNIST split by Dirichlet(0.1) over 20 clients, every client in
every round, FedAvg's CNN (pollen's `fedavg-cnn`, PFLlib's `FedAvgCNN`),
plain SGD (no momentum, no weight decay, no gradient clipping, a constant
rate: PFLlib's client), each client's own model tested on its own test
examples after every round (and not on the whole test set:
`personal-global-test = false`; PFLlib computes its training loss over
every shard instead). `write_dataset` writes pollen's shards in
PFLlib's file layout (`dataset/<name>/train/<client>.npz`, a pickled
{"x", "y"} per client, as PFLlib's own generators write), normalised as
pollen normalises them, so both frameworks train and test on the same
clients' same examples: pollen's training shards, and each client's own
test shard (test examples of its classes in proportion to its training
labels).

Each method is a pollen preset and a PFLlib `main.py` command (`METHODS`):
FedAvg, each client alone, FedPer, FedRep, LG-FedAvg, Ditto, APFL, MOON,
Per-FedAvg, FedALA, FedRoD, FedProto, FedBABU and FedBN. PFLlib's
arguments are set to pollen's preset where their defaults differ (Ditto's
and MOON's mu are 0 in PFLlib: off). FedBN needs BatchNorm, which FedAvg's
CNN lacks: both train pollen's `cnn` for it, PFLlib through
`pfllib_main.py` (its `main.py` with that model). PFLlib's output is kept per run
(`pfllib-METHOD-seed-R.log`) and read for the evaluation of the clients'
own models: Ditto's second of two a round, FedBABU's one after its
fine-tuning (pollen's FedBABU then evaluates, fine-tuning, after its last
round only, and that round's time is left out as PFLlib leaves its
fine-tuning out). Reported per method and framework: the mean over repeats of
the example-weighted accuracy over clients after the last round (PFLlib's
"Averaged Test Accuracy"), its standard deviation over repeats, the
standard deviation over clients (PFLlib's "Std Test Accuracy") and the
seconds of a round (rounds 2.. of each run, evaluation included). Repeat
r is pollen's seed r: its partition, written for PFLlib as a data set of
its own (`<name>-s<r>`), its initial model and batches. PFLlib has no seed
option: each of its clients seeds torch with 0 when it is made, and numpy
is never seeded, so which client draws which shuffle is not reproducible;
its repeats differ by that and by the partition. Both run on the CPU.
Every finished run is kept in `--out`/runs.json at once, with the settings
it ran with, so a cut-short invocation resumes with the runs it lacks (a
pollen run cut short is started again), and another invocation's settings
are refused there. `--frameworks pollen` (or `pfllib`) runs only that
framework's missing runs, to measure one side again after a change; the
table reads every kept run. Only runs of both in turn, the default, time
the two side by side on the machine's state of the moment.

Where the two differ by design: PFLlib's training loader drops each
epoch's last partial batch, pollen's trains on it; PFLlib evaluates at the
start of each round and trains one round more than it evaluates (FedBABU
fine-tunes after that round, each client from its own trained model,
where pollen's fine-tunes from the aggregated one). Per method (docs/results.md says which
difference moves which number): PFLlib's APFL steps v on v's own loss and
mixes with the client's own trained w, pollen's on the mixture's gradient
with the received one (the paper's); PFLlib's FedALA tests the adaptively
aggregated model at once, pollen's learns W during the next training;
PFLlib's FedProto weighs each client's prototype equally, pollen's by its
examples of the class (both test by the nearest global prototype);
PFLlib's Per-FedAvg trains twice a round (pollen: two local epochs) at
beta = lr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from measure import PROJECT, run_pollen, settings_of

from pollen.settings import Settings
from pollen.task.node_data import NodeData
from pollen.task.train import Preprocess

PFLLIB_COMMIT = "d832e76f6a23b833038949ec1e4fdefe63a4d350"  # 2025-11-29
PFLLIB_ORIGIN = "https://github.com/TsingZ0/PFLlib"
CACHE = Path.home() / ".cache" / "pollen-bench"
# what PFLlib's main.py imports beside torch (its environment file's list,
# less what no imported module needs)
PFLLIB_PACKAGES = ("numpy<2", "scikit-learn", "h5py", "calmsize", "ujson",
                   "matplotlib", "cvxpy", "pandas")  # fmt: skip
# PFLlib picks FedAvgCNN's 1024 features for any data set named *MNIST*
DATASET = "FashionMNIST-pollen"
BASE = (
    "data-set='fashion-mnist' download=false model='fedavg-cnn' partition='niid' "
    "alpha=0.1 num-clients=20 client-frac=1.0 local-epochs=1 batch-size=10 "
    "lr=0.005 momentum=0 weight-decay=0 max-grad-norm=0 lr-patience=100000 "
    "personal-eval-every=1 personal-global-test=false device='cpu'"
)


@dataclass(frozen=True)
class Method:
    """One method in both frameworks: pollen's run-config overrides, PFLlib's
    `main.py` algorithm and arguments (set to pollen's preset where its
    defaults differ), and which of PFLlib's printed evaluations tests the
    clients' own models: each round's `personal`-th of its `evaluations`,
    or (`after_training`) one more after the rounds (FedBABU's fine-tuned
    models), which pollen then evaluates after its last round only. A
    `model` of pollen's catalogue replaces FedAvg's CNN in both."""

    pollen: str
    algorithm: str
    arguments: tuple[str, ...] = ()
    evaluations: int = 1
    personal: int = 0
    after_training: bool = False
    model: str | None = None


METHODS = {
    # the global model on each client's own test examples, in both
    "fedavg": Method("strategy='fedavg'", "FedAvg"),
    # each client alone: nothing travels
    "local": Method("strategy='fedavg' sharing='local'", "Local"),
    "fedper": Method("strategy='fedper'", "FedPer"),
    "fedrep": Method("strategy='fedrep'", "FedRep", ("-pls", "2")),
    "lg-fedavg": Method("strategy='lg-fedavg'", "LG-FedAvg"),
    # PFLlib evaluates the global models, then the personal ones
    "ditto": Method("strategy='ditto'", "Ditto", ("-mu", "0.1", "-pls", "1"), 2, 1),
    "apfl": Method("strategy='apfl'", "APFL", ("-al", "0.5")),
    "moon": Method("strategy='moon'", "MOON", ("-mu", "1", "-tau", "0.5")),
    # PFLlib's client trains twice a round, each step on two batches, at
    # beta = lr (its -bt is not read)
    "per-fedavg": Method("strategy='per-fedavg' local-epochs=2", "PerAvg"),
    "fedala": Method(
        "strategy='fedala'", "FedALA", ("-et", "1", "-s", "80", "-p", "2")
    ),
    "fedrod": Method("strategy='fedrod'", "FedROD"),
    # both test each client by its nearest global prototype
    "fedproto": Method("strategy='fedproto'", "FedProto", ("-lam", "1")),
    "fedbabu": Method(
        "strategy='fedbabu'", "FedBABU", ("-fte", "5"), after_training=True
    ),
    # each client's BatchNorm layers (affine and statistics) stay its own
    "fedbn": Method("strategy='fedavg' bn-policy='fedbn'", "FedBN", model="cnn"),
}


@dataclass(frozen=True)
class Run:
    """One finished run of a method in one framework."""

    framework: str
    method: str
    repeat: int
    accuracy: float  # example-weighted over clients, after the last round
    client_std: float  # over clients, after the last round
    curve: list[float]  # the weighted accuracy after each round evaluated
    round_seconds: list[float]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--frameworks", default="pollen,pfllib",
        help="which frameworks' missing runs to run (the table reads every kept run)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=PROJECT / "bench-out" / "pfllib")
    parser.add_argument("--pfllib", type=Path, default=CACHE / "PFLlib")
    parser.add_argument("--pfllib-origin", default=PFLLIB_ORIGIN)
    parser.add_argument("--pfllib-venv", type=Path, default=CACHE / "pfllib-venv")
    parser.add_argument(
        "-c", "--config", default="",
        help="further pollen run-config values (data-root=..., alpha=...)",
    )  # fmt: skip
    args = parser.parse_args()
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(
            f"unknown methods {sorted(unknown)}; allowed: {', '.join(METHODS)}"
        )
    frameworks = set(args.frameworks.split(","))
    if not frameworks or frameworks - {"pollen", "pfllib"}:
        parser.error(
            f"--frameworks {args.frameworks!r}; allowed: pollen, pfllib, pollen,pfllib"
        )
    return args


def pfllib_checkout(path: Path, origin: str) -> Path:
    """PFLlib's repository at `PFLLIB_COMMIT` in `path`, cloned from
    `origin` where it is missing: its code alone (`system/`; the data sets
    it ships are hundreds of MB, and this harness writes its own)."""
    git = ["git", "-C", str(path)]
    if not (path / ".git").exists():
        subprocess.run(["git", "clone", "--quiet", "--no-checkout", origin, str(path)],
                       check=True)  # fmt: skip
        subprocess.run([*git, "sparse-checkout", "set", "system"], check=True)
    subprocess.run([*git, "checkout", "--quiet", "--detach", PFLLIB_COMMIT], check=True)
    return path


def pfllib_python(venv: Path) -> Path:
    """The Python of PFLlib's environment `venv`, made with uv where it
    cannot import what PFLlib's main.py needs."""
    python = venv / "bin" / "python"
    imports = "import torch, torchvision, sklearn, h5py, calmsize, ujson, cvxpy"
    ready = python.is_file() and (
        subprocess.run([str(python), "-c", imports], capture_output=True).returncode
        == 0
    )
    if not ready:
        uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
        pins = [
            f"{name}=={importlib.metadata.version(name)}"
            for name in ("torch", "torchvision")
        ]
        print(f"making PFLlib's environment {venv}: {', '.join(pins)}", flush=True)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        subprocess.run([uv, "venv", "--python", version, str(venv)], check=True)
        subprocess.run(
            [uv, "pip", "install", "--compile-bytecode", "--python", str(python),
             *pins, *PFLLIB_PACKAGES],
            check=True,
        )  # fmt: skip
    return python


def client_examples(
    settings: Settings, client: int, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """`client`'s training shard or own test shard as pollen's model sees it:
    float32 [N, C, H, W] normalised by the data set's statistics, int64 labels."""
    data = NodeData(settings)
    shard = data.train_shard if split == "train" else data.test_shard
    images, labels = shard(client, torch.device("cpu"))
    dataset = data.dataset()
    prep = Preprocess(dataset.mean, dataset.std, normalize=settings.normalize)
    return prep(images, None).numpy(), labels.numpy().astype(np.int64)


def write_dataset(settings: Settings, root: Path) -> list[int]:
    """pollen's shards in PFLlib's layout under `root` (its `dataset/<name>`):
    `train/<client>.npz` and `test/<client>.npz`, each a pickled {"x", "y"}
    as PFLlib reads it, and `config.json`. Returns each client's test size."""
    test_sizes = []
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for client in range(settings.num_clients):
            x, y = client_examples(settings, client, split)
            with open(root / split / f"{client}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": x, "y": y})
            if split == "test":
                test_sizes.append(len(y))
    config = {
        "num_clients": settings.num_clients,
        "num_classes": 10,
        "written by": "pollen benchmarks/pfllib_side_by_side.py",
        "pollen settings": {k: str(v) for k, v in settings.to_run_config().items()},
    }
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return test_sizes


def pollen_overrides(spec: Method, repeat: int, rounds: int) -> str:
    """pollen's run-config overrides of `BASE` for `spec`'s run with seed
    `repeat` over `rounds` rounds."""
    overrides = f"{spec.pollen} seed={repeat}"
    if spec.model:
        overrides += f" model='{spec.model}'"
    if spec.after_training:  # evaluated once, after the last round
        overrides += f" personal-eval-every={rounds}"
    return overrides


def pollen_run(
    method: str, config: str, repeat: int, out: Path, test_sizes: list[int]
) -> Run:
    """One `pollen run` of `method` with seed `repeat` (whose clients' test
    shards hold `test_sizes` examples): its row. A run directory a cut-short
    invocation left is removed first (pollen never reuses one)."""
    spec = METHODS[method]
    name = f"{method}-seed-{repeat}"
    shutil.rmtree(out / name, ignore_errors=True)
    rounds = settings_of(config).rounds
    result = run_pollen([config, pollen_overrides(spec, repeat, rounds)], out, name)
    history = json.loads((out / name / "history.json").read_text())
    clients = [str(c) for c in range(len(test_sizes))]
    per_round = [
        [row["personal"][c]["local-accuracy"] for c in clients]
        for row in history
        if row["personal"]
    ]
    curve = [float(np.average(acc, weights=test_sizes)) for acc in per_round]
    # an evaluation after training only is PFLlib's, outside its rounds' time
    seconds = result["rounds"][:-1] if spec.after_training else result["rounds"]
    return Run(
        "pollen", method, repeat, curve[-1], float(np.std(per_round[-1])), curve,
        seconds,
    )  # fmt: skip


ACCURACY = re.compile(r"^Averaged Test Accuracy: ([0-9.]+)$", re.M)
SPREAD = re.compile(r"^Std Test Accuracy: ([0-9.]+)$", re.M)
# "---- time cost ---- 41.2", or "---- 41.2" (MOON's and FedProto's servers)
SECONDS = re.compile(r"^-+(?: time cost -+)? ([0-9.]+(?:e-?[0-9]+)?)$", re.M)


def pfllib_results(
    output: str, spec: Method, rounds: int
) -> tuple[list[float], list[float], list[float]]:
    """What PFLlib's `output` for `spec` over `rounds` says: the weighted
    accuracy of the clients' own models after each round evaluated, their
    spread over clients, and each round's seconds. PFLlib evaluates at the
    start of rounds 0..R (`spec.evaluations` times each) and trains R + 1
    rounds, each timed with its evaluation."""
    accuracy = [float(a) for a in ACCURACY.findall(output)]
    spread = [float(s) for s in SPREAD.findall(output)]
    seconds = [float(s) for s in SECONDS.findall(output)]
    evaluated = spec.evaluations * (rounds + 1)
    expected = evaluated + spec.after_training
    if not len(accuracy) == len(spread) == expected or len(seconds) != rounds + 1:
        raise ValueError(
            f"{len(accuracy)} accuracies, {len(spread)} spreads and "
            f"{len(seconds)} round times in PFLlib's output; {expected}, "
            f"{expected} and {rounds + 1} expected"
        )
    if spec.after_training:
        return accuracy[evaluated:], spread[evaluated:], seconds
    personal = slice(spec.evaluations + spec.personal, evaluated, spec.evaluations)
    return accuracy[personal], spread[personal], seconds


class RunFailed(Exception):
    """A run that ended without a row (what went wrong, and where its output is)."""


def pfllib_run(
    method: str, settings: Settings, repeat: int, python: Path, checkout: Path,
    out: Path,
) -> Run:  # fmt: skip
    """PFLlib's `main.py` for `method` on repeat `repeat`'s data set (what
    `write_dataset` wrote for seed `repeat`): its row. Its output is kept in
    `out`/pfllib-METHOD-seed-R.log once it has run to the end, and read
    from there on a later invocation instead of running again."""
    spec = METHODS[method]
    log = out / f"pfllib-{method}-seed-{repeat}.log"
    if not log.exists():
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV")
        }
        main = ["main.py"]
        if spec.model:  # PFLlib's main.py with pollen's model, from pollen's tree
            shape = NodeData(settings).dataset().input_shape
            main = [str(PROJECT / "benchmarks" / "pfllib_main.py"), spec.model,
                    ",".join(map(str, shape))]  # fmt: skip
            env["PYTHONPATH"] = str(PROJECT)
        args = [
            str(python), "-u", *main, "-data", f"{DATASET}-s{repeat}", "-m", "CNN",
            "-algo", spec.algorithm, "-gr", str(settings.rounds),
            "-ls", str(settings.local_epochs), "-lbs", str(settings.batch_size),
            "-lr", str(settings.lr), "-nc", str(settings.num_clients),
            "-jr", str(settings.client_frac), "-ncl", "10", "-dev", "cpu",
            "-eg", "1", "-t", "1", *spec.arguments,
        ]  # fmt: skip
        partial = log.with_suffix(".part")
        with open(partial, "w") as output:
            done = subprocess.run(args, cwd=checkout / "system", env=env,
                                  stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
        if done.returncode != 0:
            raise RunFailed(f"PFLlib's {method} failed: its output is in {partial}")
        partial.rename(log)
    try:
        curve, spreads, seconds = pfllib_results(log.read_text(), spec, settings.rounds)
    except ValueError as error:
        raise RunFailed(f"PFLlib's {method} ({log}): {error}") from None
    return Run("pfllib", method, repeat, curve[-1], spreads[-1], curve, seconds)


def mean_round(run: Run) -> float:
    """The mean seconds of `run`'s rounds after its first (NaN for none)."""
    later = run.round_seconds[1:]
    return sum(later) / len(later) if later else float("nan")


@dataclass(frozen=True)
class Summary:
    """A method's runs in one framework: their accuracy's mean and standard
    deviation over runs (None for one), mean spread over clients and mean
    seconds a round."""

    runs: int
    accuracy: float
    spread: float | None
    client_std: float
    seconds: float

    @classmethod
    def of(cls, runs: list[Run]) -> Summary:
        accuracy = [100 * r.accuracy for r in runs]
        return cls(
            len(runs),
            statistics.mean(accuracy),
            statistics.stdev(accuracy) if len(runs) > 1 else None,
            statistics.mean(100 * r.client_std for r in runs),
            statistics.mean(mean_round(r) for r in runs),
        )

    def cell(self) -> str:
        spread = "" if self.spread is None else f" ± {self.spread:.2f}"
        return f"{self.accuracy:.2f}{spread}"


def print_table(runs: list[Run], methods: list[str]) -> None:
    """One row per method with runs in both frameworks: accuracy (mean ±
    std over runs), pollen's lead, the two runs' combined standard
    deviation sqrt(s_pollen^2 + s_PFLlib^2) (where each has several) and
    whether the lead is within it (the issue's target), spread over
    clients, and seconds a round with their ratio."""
    print("| method | runs | pollen (%) | PFLlib (%) | pollen - PFLlib (pts) "
          "| combined std (pts) | within | std over clients, pollen / PFLlib (pts) "
          "| s a round, pollen / PFLlib | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method in methods:
        pollen, pfllib = (
            [r for r in runs if (r.method, r.framework) == (method, framework)]
            for framework in ("pollen", "pfllib")
        )
        if not (pollen and pfllib):
            continue
        ours, theirs = Summary.of(pollen), Summary.of(pfllib)
        lead = ours.accuracy - theirs.accuracy
        if ours.spread is None or theirs.spread is None:
            combined, within = "-", "-"
        else:
            std = (ours.spread**2 + theirs.spread**2) ** 0.5
            combined, within = f"{std:.2f}", "yes" if abs(lead) <= std else "no"
        print(
            f"| {method} | {min(ours.runs, theirs.runs)} | {ours.cell()} "
            f"| {theirs.cell()} | {lead:+.2f} | {combined} | {within} "
            f"| {ours.client_std:.2f} / {theirs.client_std:.2f} "
            f"| {ours.seconds:.1f} / {theirs.seconds:.1f} "
            f"| {ours.seconds / theirs.seconds:.2f} |"
        )


def main() -> None:
    args = parse_args()
    config = f"{BASE} rounds={args.rounds} {args.config}"
    settings = settings_of(config)
    methods = args.methods.split(",")
    frameworks = set(args.frameworks.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / "runs.json"
    kept = json.loads(record.read_text()) if record.exists() else {"config": config}
    if kept["config"] != config:
        raise SystemExit(
            f"{record} holds runs of other settings ({kept['config']!r}); "
            "choose another --out"
        )
    runs = [Run(**r) for r in kept.get("runs", [])]

    def keep(run: Run) -> None:
        runs.append(run)
        record.write_text(
            json.dumps({"config": config, "runs": [asdict(r) for r in runs]}, indent=1)
        )

    checkout = pfllib_checkout(args.pfllib.expanduser(), args.pfllib_origin)
    python = pfllib_python(args.pfllib_venv.expanduser())
    failed: list[str] = []
    for repeat in range(1, args.repeats + 1):
        seeded = replace(settings, seed=repeat)
        started = time.monotonic()
        test_sizes = write_dataset(
            seeded, checkout / "dataset" / f"{DATASET}-s{repeat}"
        )
        print(f"seed {repeat}: pollen's shards written for PFLlib in "
              f"{time.monotonic() - started:.0f} s")  # fmt: skip
        for method in methods:
            done = {
                r.framework for r in runs if (r.method, r.repeat) == (method, repeat)
            }
            if "pollen" in frameworks - done:
                try:
                    keep(pollen_run(method, config, repeat, args.out, test_sizes))
                except RuntimeError as failure:  # `measure`'s: the others still run
                    print(failure, file=sys.stderr, flush=True)
                    failed.append(f"pollen's {method}: {str(failure)[:300]}")
            if "pfllib" in frameworks - done:
                try:
                    keep(pfllib_run(method, seeded, repeat, python, checkout, args.out))
                except RunFailed as failure:  # the other methods still run
                    print(failure, file=sys.stderr, flush=True)
                    failed.append(str(failure))
    print(f"pollen {importlib.metadata.version('pollen-fl')}, PFLlib {PFLLIB_COMMIT[:12]}, "
          f"torch {torch.__version__}; {settings.rounds} rounds")  # fmt: skip
    print_table(runs, methods)
    if failed:
        raise SystemExit("runs that failed:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
