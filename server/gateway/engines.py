"""Which engine serves: pair discovery (the shipped embedded pair by default) and construction.

The engine modules (torch) are imported only inside the constructors, when serving starts, so
the gateway package stays importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from server.cli_errors import CLIError


@dataclass(frozen=True)
class PairChoice:
    target: Path
    draft: Path
    name: str | None  # served name (None: the target directory's name)
    head: Path | None  # learned weight head directory, if any


def _check_model_dir(path: Path, flag: str) -> Path:
    if not path.is_dir():
        raise CLIError(
            f"model directory {path} does not exist; point {flag} at an HF-format checkpoint directory"
        )
    if not (path / "config.json").is_file():
        raise CLIError(f"{path} has no config.json; point {flag} at an HF-format checkpoint directory")
    return path


def choose_pair(target: Path | None, draft: Path | None, head: str | None) -> PairChoice:
    """`--target/--draft/--head` -> the pair to serve; the head defaults to the embedded pair's own
    (`head` 'none' turns it off)."""
    from server.engine.model_pair import verify_pair

    if (target is None) != (draft is None):
        raise CLIError("pass both --target and --draft, or neither (to serve the embedded pair)")
    head_dir = None if head in (None, "none") else Path(head)
    if head_dir is not None and not head_dir.is_dir():
        raise CLIError(f"no weight head at {head_dir}; train one with `dialspec train` or drop --head")
    if target is not None:
        return PairChoice(
            _check_model_dir(target, "--target"), _check_model_dir(draft, "--draft"), None, head_dir
        )
    try:
        pair = verify_pair()
    except Exception as exc:  # missing or corrupt files: the pair module's message says what to do
        raise CLIError(f"embedded pair not usable: {exc} (or pass --target and --draft)") from None
    shipped_head = Path(pair.target).parent / "head"
    if head is None and shipped_head.is_dir():
        head_dir = shipped_head
    return PairChoice(Path(pair.target), Path(pair.draft), pair.name, head_dir)


def embedded_engine(args, pair: PairChoice):
    from server.engine.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, default_cache_dir  # torch

    return EmbeddedEngine(
        EmbeddedEngineConfig(
            target_path=pair.target,
            draft_path=pair.draft,
            num_draft=args.num_draft,  # None: adaptive
            p_when_undrafted=not getattr(args, "strict_nu", False),
            max_batch=args.max_batch,
            max_context=args.max_context,
            device=args.device,
            dtype=getattr(args, "dtype", "auto"),
            served_name=args.served_name or pair.name,
            head=pair.head,  # loaded and checked against the pair when the engine is built
            cache_dir=default_cache_dir(),  # measured costs and dtype choices survive restarts
        )
    )


def sglang_engine(args):
    from server.engine.sglang.client import SGLangEngine
    from server.engine.sglang.readiness import ProbeConfig

    return SGLangEngine(
        args.sglang_url,
        args.tokenizer,
        model=args.served_name or "dialspec-pair",
        num_draft=args.num_draft or 5,  # SGLang's N is server-wide and fixed
        max_context=args.max_context,
        max_batch=args.max_batch,
        has_head=args.sglang_has_head,
        probe=ProbeConfig(interval=args.sglang_probe_interval),
    )
