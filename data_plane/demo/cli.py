"""`loraplane demo-model DIR [--seed N] [--force]`: generate the demo checkpoint and its demo adapters;
`--preset NAME [--adapters N]`: a realistically sized checkpoint and N adapters instead (data_plane/demo/presets.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

ADAPTERS_SUBDIR = "adapters"
PRESET_NAMES = ("llama-250m",)  # data_plane.demo.presets.PRESETS' keys (not imported here: --help skips torch)
DEMO_SERVED_NAME = "demo"  # the name `loraplane up` serves the demo model under


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplane demo-model",
        description="Write a small random Qwen2 checkpoint (config, safetensors, tokenizer) to DIR, and "
        "PEFT-format demo LoRA adapters for it to DIR/adapters/<name>.",
    )
    parser.add_argument("dir", type=Path, metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default: 0)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing model and adapters in DIR")
    parser.add_argument("--preset", choices=PRESET_NAMES,
                        help="instead of the small Qwen2 demo: a realistically sized random checkpoint (llama-250m: "
                        "Llama, hidden 1024, 16 layers, vocab 32000, bfloat16) and --adapters adapters (rank 16 on "
                        "q/k/v/o) named lora-000 ...")
    parser.add_argument("--adapters", type=int, default=None, metavar="N",
                        help="with --preset: how many adapters (default: 128)")
    return parser


def _main_preset(args: argparse.Namespace) -> int:
    from data_plane.demo.presets import (
        PRESET_ADAPTERS_DEFAULT,
        PRESETS,
        write_preset_adapters,
        write_preset_model,
    )

    preset, out_dir = PRESETS[args.preset], args.dir
    if (out_dir / "config.json").exists() and not args.force:
        print(f"{out_dir / 'config.json'} exists; leaving the model as it is (use --force to overwrite)")
    else:
        for path in write_preset_model(out_dir, preset, seed=args.seed):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
    count = PRESET_ADAPTERS_DEFAULT if args.adapters is None else args.adapters
    written = write_preset_adapters(out_dir, out_dir / ADAPTERS_SUBDIR, preset, count, seed=args.seed,
                                    skip_existing=not args.force)
    print(f"wrote {len(written)} adapters to {out_dir / ADAPTERS_SUBDIR} ({count - len(written)} were there)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.preset is not None:
        return _main_preset(args)
    if args.adapters is not None:
        parser.error("--adapters goes with --preset (the demo model has its 3 demo adapters)")
    out_dir: Path = args.dir
    # Imported here so that `--help` does not pay for importing torch.
    from data_plane.demo.adapters import DEMO_ADAPTERS, write_demo_adapters

    if (out_dir / "config.json").exists() and not args.force:
        print(f"{out_dir / 'config.json'} exists; leaving the model as it is (use --force to overwrite)")
    else:
        from data_plane.demo.model_builder import write_demo_model

        for path in write_demo_model(out_dir, seed=args.seed):
            print(f"wrote {path} ({path.stat().st_size} bytes)")

    adapters_root = out_dir / ADAPTERS_SUBDIR
    missing = []
    for name in DEMO_ADAPTERS:
        if (adapters_root / name / "adapter_config.json").exists() and not args.force:
            print(f"adapter {name}: {adapters_root / name} exists; leaving it as it is (use --force to overwrite)")
        else:
            missing.append(name)
    # the adapters name the base model as the demo engine serves it (`loraplane up`: --served-model-name
    # demo), so that a copy uploaded anywhere matches that engine
    written = write_demo_adapters(out_dir, adapters_root, seed=args.seed, names=missing, base_model=DEMO_SERVED_NAME)
    for name, path in written.items():
        print(f"wrote adapter {name} to {path}")
    return 0
