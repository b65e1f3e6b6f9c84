"""Copy a trained EAGLE head (or Medusa heads) into the package as the default model's, with a manifest.

    python scripts/ship_head.py data/eagle [--kind eagle|medusa] [--data data/train] [--command "..."] [--wall-time "..."]

Writes specdecode/data/heads/smollm2-135m-instruct-eagle3/ (--kind medusa:
smollm2-135m-instruct-medusa/) {config.json, model.safetensors, MANIFEST.json}: sha256 and size of each file, the command that reproduces the head, the
data recipe (from the data directory's summary and settings), the training report (from
the head's config.json), the whole wall time as given (--wall-time), and those of the heads
it was trained on from (--init).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdecode.factory import DEFAULT_EAGLE_HEAD, DEFAULT_MEDUSA_HEADS  # noqa: E402

FILES = ("config.json", "model.safetensors")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def earlier_stages(config: dict) -> list[dict]:
    """The recipes and reports of the heads this one was trained on from (train eagle
    --init), oldest last."""
    stages, seen = [], set()
    init = (config.get("recipe") or {}).get("init")
    while init and (Path(init) / "config.json").is_file():
        if Path(init).resolve() in seen:  # a head trained --init from its own directory: the chain ends
            break
        seen.add(Path(init).resolve())
        earlier = json.loads((Path(init) / "config.json").read_text())
        stages.append({"head": init, "training": earlier.get("recipe"), "report": earlier.get("report")})
        manifest = Path(init) / "MANIFEST.json"
        if manifest.is_file():  # a shipped head: its manifest already lists the stages before it
            shipped = json.loads(manifest.read_text())
            stages[-1]["data"] = shipped.get("data")
            return stages + shipped.get("earlier_stages", [])
        init = (earlier.get("recipe") or {}).get("init")
    return stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", help="directory written by specdecode train eagle (or train medusa)")
    parser.add_argument("--kind", default="eagle", choices=["eagle", "medusa"], help="which default it becomes")
    parser.add_argument("--data", default="data/train", help="the training data directory (for the recipe)")
    parser.add_argument("--command", default="make eagle-head", help="the command that reproduces the head")
    parser.add_argument("--wall-time", default=None,
                        help="how long making the head took, and on which machine (free text for the manifest)")
    args = parser.parse_args()
    source, data = Path(args.head), Path(args.data)
    destination = DEFAULT_MEDUSA_HEADS if args.kind == "medusa" else DEFAULT_EAGLE_HEAD
    missing = [name for name in FILES if not (source / name).is_file()]
    if missing:
        print(f"ship_head: {source} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    config = json.loads((source / "config.json").read_text())
    kind = "medusa" if "medusa" in str(config.get("architecture", "")) else "eagle"
    if kind != args.kind:  # shipped in the other's place, it would replace the default of the wrong kind
        print(f"ship_head: {source} holds {kind} heads ({config.get('architecture')!r}); --kind {args.kind} "
              f"would ship them as the default {args.kind} head", file=sys.stderr)
        return 2
    if not data.is_dir():
        print(f"ship_head: --data {data} is not a directory (the manifest records its recipe)", file=sys.stderr)
        return 2
    # the manifest's data recipe is read from --data: it must be the data the head learnt from
    # (found in review: any directory was recorded, beside a recipe naming another target)
    recipe = config.get("recipe") or {}
    settings_path = data / "answers.settings.json"
    data_target = json.loads(settings_path.read_text()).get("target") if settings_path.is_file() else None
    if recipe.get("target") and data_target and data_target.split("|")[0] != recipe["target"].split("|")[0]:
        print(f"ship_head: {data} holds answers of {data_target.split('|')[0]!r}; the head was trained for "
              f"{recipe['target'].split('|')[0]!r}", file=sys.stderr)
        return 2
    if recipe.get("data"):
        from specdecode.train.eagle import data_fingerprint, training_sequences

        sequences = training_sequences(data, recipe.get("corpus_tokens", 0), recipe.get("max_length", 768))
        held = data_fingerprint([(s, None) for s in sequences if not s.held_out])
        if held != recipe["data"]:
            print(f"ship_head: {data} is not the data {source} was trained on (its training sequences hash to "
                  f"{held}, the head's recipe says {recipe['data']})", file=sys.stderr)
            return 2
    earlier = earlier_stages(config)  # before copying: --init may be the shipped head itself
    destination.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(source / name, destination / name)
    recipe = {}
    for name in ("summary.json", "answers.settings.json"):
        if (data / name).is_file():
            recipe[name.removesuffix(".json")] = json.loads((data / name).read_text())
    manifest = {
        "files": {name: {"sha256": sha256(destination / name), "bytes": (destination / name).stat().st_size}
                  for name in FILES},
        "reproduce": args.command,
        "wall_time": args.wall_time,
        "data": recipe,
        "training": config.get("recipe"),
        "report": config.get("report"),
        "earlier_stages": earlier,
    }
    (destination / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(f["bytes"] for f in manifest["files"].values())
    print(f"shipped {source} -> {destination.relative_to(ROOT)} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
