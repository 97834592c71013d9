"""ASR cost model: audio hours transcribed per dollar, measured GPUs beside a modelled Trainium2.

Two kinds of rows, never to be confused:

* **measured**: RTFx read from benchmark JSON lines (``--measured FILE.jsonl``; records like
  ``{"system": "polyaccel", "model": "canary-1b-flash", "batch": 64, "rtfx": 9000.0,
  "device": "1x H200"}``); the best batch of each (system, model, device) is kept and priced
  from the instance price table (``--price NAME=USD_PER_HOUR`` overrides it).
* **modelled, not measured**: a roofline estimate for one Trainium2 chip. Per audio second a
  model shape does G GFLOP and moves B GB of HBM traffic; one chip needs
  ``max(G x 1e9 / (peak FLOP/s x mfu), B x 1e9 / (HBM bytes/s x hbm_eff))`` seconds for them, so
  RTFx = 1 / that time. The chip runs 8 replicas (8 NeuronCores at LNC=1), which is what makes
  the whole chip's rate reachable for a batch job.

Then, for both kinds:  audio hours per USD = RTFx / (USD per hour of the device)
                       USD per 1000 audio hours = 1000 x (USD per hour) / RTFx

Prints one JSON line per row, the assumptions, a table and an MFU sensitivity table. The
formula, the sources of every number and how to run it: docs/cost_model.md.

  python tools/cost_model.py --measured asr_bench.jsonl
  python tools/cost_model.py --measured asr_bench.jsonl --price H200=3.5 --mfu 0.3
  python tools/cost_model.py --gflop-per-audio-s 21.9 --gbyte-per-audio-s 0.06 --model-name mine
  python tools/cost_model.py --preset canary-1b-flash=21.9:0.06 --preset whisper-large-v3-turbo=76
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling tools, also when loaded by path
from plot_bench import read_points  # noqa: E402  (one JSON-lines reader for the tools)

# ---- prices (USD per hour; they change: check, and pass --price) ------------------------------

PRICES_USD_PER_HOUR: dict[str, float] = {
    # Per GPU-hour. AWS "EC2 Capacity Blocks for ML" price list, US East (Ohio): p5en.48xlarge
    # (8x H200) USD 43.26 per instance-hour, so 43.26 / 8 = 5.41 per GPU; the list then said its
    # rates were set for 2025-01-01 (read 2026-11-29 from a stored copy). On-demand rates, other
    # regions and other clouds differ, and AWS has cut GPU instance prices since (mid-2025).
    "H200": 43.26 / 8,
    "H100": 39.33 / 8,  # same list: p5.48xlarge, 8x H100
    "A100": 14.75 / 8,  # same list: p4d.24xlarge, 8x A100 40 GB
    # One Trainium2 chip (8 NeuronCores, 96 GiB HBM, 12 vCPU): about USD 2.2/h on demand in one
    # 2026 third-party report; not checked against AWS.
    "trn2.3xlarge": 2.2,
}
"""Instance or per-accelerator prices; a device ``"Nx NAME"`` costs N x ``NAME``'s price."""

GPU_PEAK_TFLOPS: dict[str, float] = {
    "H200": 790.0,  # 8192^3 bf16 matmul measured on the device machine (tools/bench_moe.py)
}
"""Dense bf16 rate per GPU used to state the MFU a measured RTFx implies (absent: not stated)."""


# ---- hardware and model shapes ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Chip:
    """An accelerator chip for the roofline: peak dense bf16 TFLOP/s, HBM TB/s, cores, and the
    price key of the smallest instance that holds ``chips_per_instance`` of it."""

    name: str
    peak_tflops: float
    hbm_tb_s: float
    cores: int
    instance: str
    chips_per_instance: int = 1


TRN2 = Chip("trn2", peak_tflops=667.0, hbm_tb_s=2.9, cores=8, instance="trn2.3xlarge")
"""Trainium2 per chip: 8 NeuronCore-v3, 667 TFLOP/s bf16 dense, 96 GiB HBM at 2.9 TB/s."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What one second of audio costs a model: GFLOP computed and GB moved to and from HBM."""

    name: str
    gflop_per_audio_s: float
    gbyte_per_audio_s: float
    source: str = "command line"


PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    # 30 s utterances, 96 greedy tokens. GFLOP: polyaccel.asr.conformer_config.flops_per_audio_second
    # for the ConformerAED shapes, the project brief's figure for turbo, our own count for large-v3 (same
    # encoder, 32 decoder layers). GB: rough HBM traffic at batch 64 (encoder activations, weights
    # read once per batch step, cross-attention K/V read at every decode step); docs/cost_model.md.
    ModelShape("canary-1b-flash", 21.9, 0.06, "ConformerAED canary-1b-flash shape"),
    ModelShape("canary-180m-flash", 4.66, 0.04, "ConformerAED canary-180m-flash shape"),
    ModelShape("whisper-large-v3-turbo", 76.0, 0.25, "project brief; 4 decoder layers"),
    ModelShape("whisper-large-v3", 92.0, 1.0, "our count; 32 decoder layers"),
)}
"""Built-in model shapes, modelled when no shape is given on the command line."""

MEASURED_KEYS = ("system", "model", "batch", "rtfx", "device")
"""Keys a benchmark record needs to be used."""

MODELLED = "modelled, not measured"


# ---- arithmetic ---------------------------------------------------------------------------------

def cost_fields(rtfx: float, usd_per_hour: float) -> dict[str, float]:
    """Audio hours per USD and USD per 1000 audio hours of a device that transcribes ``rtfx``
    audio seconds per wall second (so ``rtfx`` audio hours per hour) at ``usd_per_hour``."""
    return {"audio_h_per_usd": rtfx / usd_per_hour, "usd_per_1000_audio_h": 1000.0 * usd_per_hour / rtfx}


def roofline_rtfx(shape: ModelShape, chip: Chip, *, mfu: float, hbm_eff: float) -> tuple[float, str]:
    """RTFx of one chip for ``shape`` and which side bounds it (``"compute"`` or ``"memory"``):
    seconds per audio second = max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s)."""
    t_compute = shape.gflop_per_audio_s * 1e9 / (chip.peak_tflops * 1e12 * mfu)
    t_memory = shape.gbyte_per_audio_s * 1e9 / (chip.hbm_tb_s * 1e12 * hbm_eff)
    return 1.0 / max(t_compute, t_memory), "compute" if t_compute >= t_memory else "memory"


def canonical_model(name: str) -> str:
    """Model name as the preset table spells it: ``"openai/whisper-large-v3-turbo"`` and
    ``"canary_1b_flash_shape"`` become ``"whisper-large-v3-turbo"`` and ``"canary-1b-flash"``."""
    name = name.rsplit("/", 1)[-1].lower().replace("_", "-")
    return name.removesuffix("-shape")


def parse_device(device: str) -> tuple[int, str]:
    """``"8x H200"`` -> ``(8, "H200")``; a bare name (``"trn2.3xlarge"``) counts once."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(.+?)\s*", device)
    return (int(m.group(1)), m.group(2)) if m else (1, device.strip())


def device_price(device: str, prices: dict[str, float]) -> float:
    """USD per hour of ``device``: its own entry if the table has one, else count x the price of
    its accelerator, found by name or as a word of it (``"NVIDIA H200"``, as torch names the GPU,
    costs one ``H200``); names compared without case. Raises KeyError naming ``--price``."""
    lower = {k.lower(): v for k, v in prices.items()}
    if device.strip().lower() in lower:
        return lower[device.strip().lower()]
    count, name = parse_device(device)
    if name.lower() in lower:
        return count * lower[name.lower()]
    words = [k for k in lower if re.search(rf"(?<![\w.-]){re.escape(k)}(?![\w.-])", name.lower())]
    if len(words) == 1:
        return count * lower[words[0]]
    raise KeyError(f"no price for device {device!r}: pass --price {name}=USD_PER_HOUR")


def parse_prices(items: Iterable[str], base: dict[str, float] | None = None) -> dict[str, float]:
    """The built-in price table updated with ``NAME=USD_PER_HOUR`` strings."""
    prices = dict(PRICES_USD_PER_HOUR if base is None else base)
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name.strip():
            raise ValueError(f"--price wants NAME=USD_PER_HOUR, got {item!r}")
        prices[name.strip()] = float(value)
    return prices


def parse_preset(item: str) -> ModelShape:
    """``NAME=GFLOP[:GBYTE]`` -> a shape; GBYTE defaults to the built-in preset's, else 0."""
    name, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"--preset wants NAME=GFLOP[:GBYTE], got {item!r}")
    gflop, _, gbyte = value.partition(":")
    known = PRESETS.get(canonical_model(name))
    default_gb = known.gbyte_per_audio_s if known else 0.0
    return ModelShape(name.strip(), float(gflop), float(gbyte) if gbyte else default_gb)


# ---- measured rows ------------------------------------------------------------------------------

def read_records(paths: Iterable[str]) -> list[dict]:
    """Benchmark records from JSON-lines files; lines that are not JSON objects, lack a key of
    :data:`MEASURED_KEYS` or have a non-positive RTFx are skipped."""

    def positive_rtfx(rec: dict) -> bool:
        try:
            return float(rec["rtfx"]) > 0
        except (TypeError, ValueError):
            return False

    return [rec for rec in read_points(paths, MEASURED_KEYS) if positive_rtfx(rec)]


def best_batches(records: Iterable[dict]) -> list[dict]:
    """The record with the highest RTFx of each (system, model, device), in first-seen order
    (on a tie the smaller batch wins: same throughput, less latency and memory)."""
    best: dict[tuple, dict] = {}
    for rec in records:
        key = (rec["system"], rec["model"], rec["device"])
        cur = best.get(key)
        if cur is None or (float(rec["rtfx"]), -rec["batch"]) > (float(cur["rtfx"]), -cur["batch"]):
            best[key] = rec
    return list(best.values())


def measured_row(rec: dict, prices: dict[str, float]) -> dict:
    """One priced row for a measured record; states the MFU it implies when the model's FLOPs per
    audio second and the GPU's peak are known."""
    rtfx, usd_h = float(rec["rtfx"]), device_price(rec["device"], prices)
    row = {"kind": "measured", "system": rec["system"], "model": rec["model"], "device": rec["device"],
           "batch": rec["batch"], "rtfx": rtfx, "usd_per_h": usd_h, **cost_fields(rtfx, usd_h)}
    shape = PRESETS.get(canonical_model(str(rec["model"])))
    count, gpu = parse_device(rec["device"])
    peak = next((v for k, v in GPU_PEAK_TFLOPS.items() if k.lower() in gpu.lower().split()), None)
    if shape is not None and peak is not None:
        row["implied_mfu"] = rtfx * shape.gflop_per_audio_s * 1e9 / (count * peak * 1e12)
    return row


# ---- modelled rows ------------------------------------------------------------------------------

def modelled_row(shape: ModelShape, chip: Chip, prices: dict[str, float], *,
                 mfu: float, hbm_eff: float) -> dict:
    """One priced roofline row for ``shape`` on one ``chip`` (labelled modelled, not measured)."""
    rtfx, bound = roofline_rtfx(shape, chip, mfu=mfu, hbm_eff=hbm_eff)
    usd_h = prices[chip.instance] / chip.chips_per_instance
    return {"kind": "modelled", "note": MODELLED, "system": f"{chip.name} roofline", "model": shape.name,
            "device": f"1x {chip.name} ({chip.instance}, {chip.cores} cores)", "batch": None,
            "rtfx": rtfx, "rtfx_per_core": rtfx / chip.cores, "bound": bound, "usd_per_h": usd_h,
            **cost_fields(rtfx, usd_h), "gflop_per_audio_s": shape.gflop_per_audio_s,
            "gbyte_per_audio_s": shape.gbyte_per_audio_s, "mfu": mfu, "hbm_eff": hbm_eff,
            "peak_tflops": chip.peak_tflops, "hbm_tb_s": chip.hbm_tb_s}


# ---- text output --------------------------------------------------------------------------------

def format_table(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width table: RTFx, price, audio hours per USD, USD per 1000 hours."""
    head = ("kind", "system", "model", "device", "batch", "RTFx", "USD/h", "audio h/USD", "USD/1000 audio h")
    body = [(
        MODELLED if r["kind"] == "modelled" else "measured", r["system"], r["model"], r["device"],
        "-" if r["batch"] is None else str(r["batch"]), f"{r['rtfx']:,.0f}", f"{r['usd_per_h']:.2f}",
        f"{r['audio_h_per_usd']:,.0f}", f"{r['usd_per_1000_audio_h']:.3f}") for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def sensitivity_table(shapes: Sequence[ModelShape], chip: Chip, prices: dict[str, float], *,
                      mfus: Sequence[float], hbm_eff: float) -> str:
    """RTFx and USD per 1000 audio hours of each modelled shape at each MFU in ``mfus``."""
    head = ["model"] + [f"MFU {m:g}: RTFx / USD per 1000 h" for m in mfus]
    body = []
    for shape in shapes:
        cells = [shape.name]
        for m in mfus:
            r = modelled_row(shape, chip, prices, mfu=m, hbm_eff=hbm_eff)
            cells.append(f"{r['rtfx']:,.0f} / {r['usd_per_1000_audio_h']:.3f}" + (" (mem)" if r["bound"] == "memory" else ""))
        body.append(cells)
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def assumptions(chip: Chip, prices: dict[str, float], shapes: Sequence[ModelShape], *,
                mfu: float, hbm_eff: float, used_devices: Iterable[str]) -> list[str]:
    """Every number the rows depend on, one line each."""
    out = [
        f"{chip.name}: {chip.peak_tflops:g} TFLOP/s bf16 dense and {chip.hbm_tb_s:g} TB/s HBM per chip, "
        f"{chip.cores} NeuronCores at LNC=1 (one replica each); {chip.instance} holds "
        f"{chip.chips_per_instance} chip(s) at USD {prices[chip.instance]:.2f}/h",
        f"efficiency: MFU {mfu:g} of peak FLOP/s, {hbm_eff:g} of peak HBM bandwidth; RTFx = 1 / max("
        "GFLOP/(TFLOP/s x MFU), GB/(TB/s x eff)) per audio second; whole workload at one MFU, "
        "decode steps included",
    ]
    out += [f"shape {s.name}: {s.gflop_per_audio_s:g} GFLOP and {s.gbyte_per_audio_s:g} GB per audio "
            f"second ({s.source})" for s in shapes]
    for dev in sorted(set(used_devices)):
        out.append(f"price {dev}: USD {device_price(dev, prices):.3f}/h")
    out.append("prices are snapshots (sources in tools/cost_model.py, docs/cost_model.md); they change: "
               "check current ones and pass --price NAME=USD_PER_HOUR")
    out.append("measured rows: the best batch of each (system, model, device) from --measured")
    return out


# ---- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (``--help`` explains each knob)."""
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog="Trainium2 rows are a roofline estimate (modelled, not measured); measured rows come "
               "only from --measured. Formula and sources: docs/cost_model.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measured", action="append", default=[], metavar="FILE.jsonl",
                   help="benchmark JSON lines with system, model, batch, rtfx, device (repeatable); "
                        "the best batch of each system/model/device is priced")
    p.add_argument("--price", action="append", default=[], metavar="NAME=USD_PER_HOUR",
                   help="override or add a price: per accelerator (H200=5.41, used as N x for 'Nx H200'), "
                        "per device string, or the Trainium instance (trn2.3xlarge=2.2)")
    p.add_argument("--gflop-per-audio-s", type=float, metavar="GFLOP",
                   help="model one shape with this many GFLOP per audio second")
    p.add_argument("--gbyte-per-audio-s", type=float, default=0.0, metavar="GB",
                   help="HBM bytes moved per audio second for --gflop-per-audio-s (default 0: compute only)")
    p.add_argument("--model-name", default="custom", help="name of the --gflop-per-audio-s shape")
    p.add_argument("--preset", action="append", default=[], metavar="NAME=GFLOP[:GB]",
                   help="model this shape (repeatable); without any shape the built-in presets are "
                        f"modelled: {', '.join(PRESETS)}")
    p.add_argument("--mfu", type=float, default=0.35, help="achieved fraction of peak FLOP/s (default 0.35)")
    p.add_argument("--hbm-eff", type=float, default=0.7,
                   help="achieved fraction of peak HBM bandwidth (default 0.7)")
    p.add_argument("--sensitivity", default="0.2,0.35,0.5", metavar="MFU,...",
                   help="MFUs of the sensitivity table (default 0.2,0.35,0.5)")
    p.add_argument("--trn-tflops", type=float, default=TRN2.peak_tflops, help="Trainium2 bf16 dense TFLOP/s per chip")
    p.add_argument("--trn-hbm-tb-s", type=float, default=TRN2.hbm_tb_s, help="Trainium2 HBM TB/s per chip")
    p.add_argument("--out", metavar="FILE.jsonl", help="also write the JSON lines here")
    return p


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one existing file (through links too)."""
    try:
        return Path(a).samefile(b)
    except OSError:
        return False


def _why(e: Exception) -> str:
    """``FILE: reason`` for an OSError (not ``[Errno 2] ...``); other errors as they are."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def main(argv: Sequence[str] | None = None) -> int:
    """Print one JSON line per row, then the assumptions, the table and the MFU sensitivity."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        prices = parse_prices(args.price)
        shapes = [parse_preset(s) for s in args.preset]
        mfus = [float(m) for m in args.sensitivity.split(",") if m.strip()]
    except ValueError as e:
        parser.error(str(e))
    # every number divides somewhere: zero, negative or NaN is a usage error, not a traceback
    positive = {"--mfu": args.mfu, "--hbm-eff": args.hbm_eff, "--trn-tflops": args.trn_tflops,
                "--trn-hbm-tb-s": args.trn_hbm_tb_s, **{f"--sensitivity {m:g}": m for m in mfus},
                **{f"--price {k}": v for k, v in prices.items()}}
    if args.gflop_per_audio_s is not None:
        shapes.append(ModelShape(args.model_name, args.gflop_per_audio_s, args.gbyte_per_audio_s))
    bad = [f"{k} {v:g} (must be > 0)" for k, v in positive.items() if not v > 0]
    bad += [f"shape {s.name}: {s.gflop_per_audio_s:g} GFLOP, {s.gbyte_per_audio_s:g} GB (each >= 0, not both 0)"
            for s in shapes if not (min(s.gflop_per_audio_s, s.gbyte_per_audio_s) >= 0
                                    and s.gflop_per_audio_s + s.gbyte_per_audio_s > 0)]
    if bad:
        parser.error("bad numbers: " + "; ".join(bad))
    if args.out and any(_same_file(args.out, m) for m in args.measured):
        parser.error(f"--out {args.out} is a --measured input: writing the rows there would destroy it")
    chip = dataclasses.replace(TRN2, peak_tflops=args.trn_tflops, hbm_tb_s=args.trn_hbm_tb_s)
    if not shapes:
        shapes = list(PRESETS.values())

    try:
        rows = [measured_row(r, prices) for r in best_batches(read_records(args.measured))]
    except KeyError as e:
        print(f"cost_model.py: error: {e.args[0]}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as e:
        print(f"cost_model.py: error: --measured: {_why(e)}", file=sys.stderr)
        return 2
    rows += [modelled_row(s, chip, prices, mfu=args.mfu, hbm_eff=args.hbm_eff) for s in shapes]

    lines = [json.dumps(r) for r in rows]
    print("\n".join(lines))
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        except OSError as e:
            print(f"cost_model.py: error: --out: {_why(e)}", file=sys.stderr)
            return 2
    print("\nAssumptions:")
    for a in assumptions(chip, prices, shapes, mfu=args.mfu, hbm_eff=args.hbm_eff,
                         used_devices=[r["device"] for r in rows if r["kind"] == "measured"]):
        print(f"  - {a}")
    print(f"\n{format_table(rows)}")
    print(f"\n{chip.name} sensitivity ({MODELLED}; HBM efficiency {args.hbm_eff:g}; (mem) = memory-bound):")
    print(sensitivity_table(shapes, chip, prices, mfus=mfus, hbm_eff=args.hbm_eff))
    return 0


if __name__ == "__main__":
    sys.exit(main())
