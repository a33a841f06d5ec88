"""Which runner serves a checkpoint, and how a pooling model pools: vLLM's rules and names.

`--runner auto` picks pooling for a checkpoint that declares it (a sentence-transformers
`modules.json` with a Pooling module, or a base-model architecture such as `Qwen2Model`, which
has no LM head), else generate. `--convert embed` (what auto means for a `*ForCausalLM`
checkpoint served by the pooling runner) drops the LM head and pools the final hidden states.

How to pool comes from the sentence-transformers files (`1_Pooling/config.json`: last-token,
mean or CLS; a `Normalize` module in `modules.json`), each key overridable with vLLM's
`--pooler-config`; a decoder without those files pools its last token and normalises, as vLLM's
default for embedding decoders. Matryoshka truncation (`dimensions`) is allowed only where
config.json declares it (`is_matryoshka` or `matryoshka_dimensions`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagefleet.engine.json_flag import parse_json_object

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# Architecture suffixes that carry an LM head: vLLM's table (the rest of `*Model` pool).
_GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel")
# sentence-transformers pooling modes we implement; the others are refused by name.
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_LEGACY_MODES = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_USER_KEYS = ("pooling_type", "normalize", "use_activation", "dimensions")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine turns a prompt's hidden states into its vector."""

    pooling_type: str = "LAST"  # LAST | MEAN | CLS
    normalize: bool = True  # L2-normalise the vector (sentence-transformers' Normalize)
    dimensions: int | None = None  # default Matryoshka truncation (None: the full vector)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type {self.pooling_type!r} is not supported: one of "
                f"{', '.join(POOLING_TYPES)}"
            )

    @property
    def uses_every_row(self) -> bool:
        """MEAN and CLS read hidden states a prefix-cache hit would skip (vLLM, likewise,
        turns prefix caching off for them); LAST reads only the last row, always computed."""
        return self.pooling_type != "LAST"


def parse_pooler_overrides(value: str | dict | None) -> dict[str, Any]:
    """vLLM's --pooler-config (JSON text or a dict) as checked overrides; unknown keys are an
    error naming them, so a setting never silently does nothing."""
    if value is None or value == "":
        return {}
    value = parse_json_object("--pooler-config", value, _USER_KEYS)
    overrides: dict[str, Any] = {}
    if value.get("pooling_type") is not None:
        overrides["pooling_type"] = str(value["pooling_type"]).upper()
    for key in ("normalize", "use_activation"):  # vLLM's old and new name of one switch
        if value.get(key) is not None:
            if not isinstance(value[key], bool):
                raise ValueError(f"--pooler-config: {key} must be true or false")
            overrides["normalize"] = value[key]
    dims = value.get("dimensions")
    if dims is not None:
        if not isinstance(dims, int) or isinstance(dims, bool) or dims < 1:
            raise ValueError("--pooler-config: dimensions must be a positive integer")
        overrides["dimensions"] = dims
    return overrides


@dataclass(frozen=True)
class SentenceTransformers:
    """What a checkpoint's sentence-transformers files say (None fields: not said)."""

    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None


def read_sentence_transformers(path: str | Path) -> SentenceTransformers | None:
    """The pooling a checkpoint declares in sentence-transformers files; None without a
    modules.json. Modules we cannot reproduce (Dense, max pooling, prompts left out of the
    pool, lower-casing) are refused, naming them, rather than served differently."""
    path = Path(path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    pooling_type = None
    for kind, where in kinds:
        if kind == "Transformer" and where in ("", "."):
            continue
        if kind == "Pooling":
            pooling_type = _st_pooling_type(path / where / "config.json")
        elif kind != "Normalize":
            raise ValueError(
                f"{modules_file}: the sentence-transformers module {kind} ({where or 'root'}) "
                "is not supported (Transformer at the root, Pooling, Normalize)"
            )
    if pooling_type is None:
        return None  # no Pooling module: nothing declared (vLLM's reading too)
    return SentenceTransformers(
        pooling_type,
        normalize=any(kind == "Normalize" for kind, _ in kinds),
        max_seq_length=_st_max_seq_length(path / "sentence_bert_config.json"),
    )


def _st_pooling_type(config_file: Path) -> str:
    """The one pooling mode of a Pooling module's config, in either of its formats
    (sentence-transformers 6's `pooling_mode`, or the older `pooling_mode_*` switches)."""
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{config_file}: include_prompt false is not supported")
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_MODES.items() if config.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{config_file}: pooling mode {modes} is not supported (one of lasttoken, mean, cls)"
        )
    return _ST_MODES[modes[0]]


def _st_max_seq_length(config_file: Path) -> int | None:
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if config.get("do_lower_case"):
        raise ValueError(f"{config_file}: do_lower_case is not supported")
    length = config.get("max_seq_length")
    return int(length) if length else None


@dataclass(frozen=True)
class PoolingModel:
    """A pooling engine's resolved view of its checkpoint."""

    pooler: PoolerConfig
    hidden_size: int
    # Matryoshka support as config.json declares it: any width (True), the listed widths, or
    # none (False).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = field(default=())
    max_seq_length: int | None = None  # sentence-transformers' cap on the input

    def check_dimensions(self, dimensions: int) -> None:
        """Raise ValueError unless the model can truncate its vectors to `dimensions`."""
        if not self.matryoshka:
            raise ValueError(
                "this model does not support matryoshka representation (config.json declares "
                "neither is_matryoshka nor matryoshka_dimensions): dimensions cannot be set"
            )
        if dimensions < 1 or dimensions > self.hidden_size:
            raise ValueError(f"dimensions must be between 1 and {self.hidden_size}")
        allowed = self.matryoshka_dimensions
        if allowed and dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {list(allowed)} for this model")


def resolve_pooling(
    path: str | Path, hf_config: dict, overrides: str | dict | None
) -> PoolingModel:
    """The checkpoint's pooling (sentence-transformers files, else vLLM's decoder default:
    last token, normalised), with --pooler-config's keys over it."""
    st = read_sentence_transformers(path)
    pooler = PoolerConfig()
    if st is not None:
        pooler = PoolerConfig(st.pooling_type, st.normalize)
    pooler = replace(pooler, **parse_pooler_overrides(overrides))
    declared = hf_config.get("matryoshka_dimensions") or ()
    model = PoolingModel(
        pooler,
        hidden_size=int(hf_config["hidden_size"]),
        matryoshka=bool(declared) or bool(hf_config.get("is_matryoshka")),
        matryoshka_dimensions=tuple(int(d) for d in declared),
        max_seq_length=st.max_seq_length if st is not None else None,
    )
    if pooler.dimensions is not None:
        try:
            model.check_dimensions(pooler.dimensions)
        except ValueError as e:
            raise ValueError(f"--pooler-config dimensions: {e}") from None
    return model


def has_lm_head(architecture: str) -> bool:
    """Whether an architecture name carries an LM head (vLLM's suffix table)."""
    return architecture.endswith(_GENERATIVE_SUFFIXES) or not architecture.endswith("Model")


def resolve_runner(runner: str, convert: str, path: str | Path, hf_config: dict) -> str:
    """`generate` or `pooling` for --runner/--convert and this checkpoint; a combination that
    cannot work is a ValueError saying which flag to change."""
    archs = hf_config.get("architectures") or [""]
    generative = has_lm_head(archs[0])
    if runner == "auto":
        declared = read_sentence_transformers(path) is not None
        runner = "pooling" if declared or not generative or convert == "embed" else "generate"
    if runner == "generate":
        if convert == "embed":
            raise ValueError(
                "--convert embed makes a pooling model: use --runner pooling (or auto)"
            )
        if not generative:
            raise ValueError(
                f"{archs[0]} has no LM head, so it cannot generate: serve it with --runner "
                "pooling (or auto)"
            )
    elif convert == "none" and generative:
        raise ValueError(
            f"{archs[0]} is a generative architecture: --runner pooling needs --convert embed "
            "(or auto) to pool its hidden states"
        )
    return runner
