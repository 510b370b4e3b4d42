"""Learned weight heads on disk: save, load, and the pair fingerprint that ties a head to its pair.

A head is only meaningful on the hidden states of the exact draft/target pair it was trained on,
so its config records the pair's name, hidden sizes and a fingerprint (sha256 over the pair's
weight files) and `load_head` checks them. Format: `head.safetensors` + `head.json` in one
directory (`dialspec-weight-head/1`). The model itself is `verifier.head.WeightHead`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from verifier.head import HeadConfig, WeightHead

WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "head.json"


def pair_fingerprint(target_path: str | Path, draft_path: str | Path) -> str:
    """sha256 over the target's then the draft's `*.safetensors` (sorted by name), as hex."""
    digest = hashlib.sha256()
    for root in (Path(target_path), Path(draft_path)):
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {root}")
        for f in files:
            digest.update(f.name.encode())
            with f.open("rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def pair_hidden_sizes(target_path: str | Path, draft_path: str | Path) -> tuple[int, int]:
    """(draft_hidden, target_hidden) read from the pair's `config.json` files."""
    t = json.loads((Path(target_path) / "config.json").read_text())["hidden_size"]
    d = json.loads((Path(draft_path) / "config.json").read_text())["hidden_size"]
    return int(d), int(t)


def head_for_pair(target_path, draft_path, pair_name: str, hidden: int = 0, **kwargs) -> WeightHead:
    """A fresh (w = 0.5) head sized and stamped for a pair."""
    d, t = pair_hidden_sizes(target_path, draft_path)
    fp = pair_fingerprint(target_path, draft_path)
    cfg = HeadConfig(d, t, hidden=hidden, pair_name=pair_name, pair_fingerprint=fp, **kwargs)
    return WeightHead(cfg)


def save_head(head: WeightHead, directory: str | Path, extra: dict | None = None) -> Path:
    """Write `head.safetensors` and `head.json` (config + optional training metadata)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    meta = {"config": asdict(head.config), "format": "dialspec-weight-head/1"}
    if extra:
        meta["training"] = extra
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def load_head(
    directory: str | Path,
    pair_name: str | None = None,
    *,
    target_path: str | Path | None = None,
    draft_path: str | Path | None = None,
    check_fingerprint: bool = True,
) -> WeightHead:
    """Load a head saved by `save_head`, refusing (ValueError) a head trained for another pair.

    Checks, when given: `pair_name`; the hidden sizes of `target_path`/`draft_path`; and (unless
    `check_fingerprint=False`) their weight fingerprint.
    """
    path = Path(directory)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no weight head at {path} (need {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = HeadConfig(**json.loads(cfg_file.read_text())["config"])
    where = f"the head at {path} was trained for pair {config.pair_name!r}"
    if pair_name is not None and pair_name != config.pair_name:
        raise ValueError(f"{where}, not {pair_name!r}; train a head for this pair (dialspec train)")
    if target_path is not None and draft_path is not None:
        d, t = pair_hidden_sizes(target_path, draft_path)
        if (d, t) != (config.draft_hidden, config.target_hidden):
            raise ValueError(
                f"{where} with hidden sizes (draft {config.draft_hidden}, target {config.target_hidden}); "
                f"this pair has ({d}, {t})"
            )
        fingerprint = check_fingerprint and config.pair_fingerprint
        if fingerprint and pair_fingerprint(target_path, draft_path) != config.pair_fingerprint:
            raise ValueError(f"{where}, whose weights differ from {target_path} + {draft_path}")
    from safetensors.torch import load_file

    head = WeightHead(config)
    head.load_state_dict(load_file(str(path / WEIGHTS_FILE)), strict=True)
    return head.eval()
