"""Where an objective comes from: the built-in default, an ObjectiveConfig,
text format or a file, with keyword overrides on top."""

from __future__ import annotations

import os
from typing import SupportsIndex, Union

from dflash._core import ObjectiveConfig

# What names a config: None (the default), a config, text format or a path.
ConfigSource = Union[None, ObjectiveConfig, str, os.PathLike[str]]
# An override's value (ObjectiveConfig.with_overrides checks each keyword's).
Override = Union[str, float, SupportsIndex]


_CONFIG_SUFFIXES = (".textproto", ".txtpb", ".pbtxt")


def _names_a_path(text: str) -> bool:
    """Whether a str config is a path: an existing file, or a one-line str
    with a path separator or a config file's suffix and none of text
    format's '{' and ':' (a missing path then gets a message saying so,
    not a parse error of the path as text)."""
    if os.path.isfile(text):
        return True
    if "\n" in text or "{" in text or ":" in text:
        return False
    return os.sep in text or text.strip().endswith(_CONFIG_SUFFIXES)


def objective_config(config: ConfigSource = None,
                     **overrides: Override) -> ObjectiveConfig:
    """The ObjectiveConfig that `config` and `overrides` name.

    config: None (configs/dflash_default.textproto: dflash loss, gamma 7,
    chunks of 128 blocks, fused head), an ObjectiveConfig, a path
    (os.PathLike; a str naming an existing file, or one line holding a path
    separator or ending in .textproto, .txtpb or .pbtxt, without '{' or
    ':') or protobuf text format (a leading UTF-8 BOM is ignored).
    overrides: loss_type, lk_loss_type, kl_scale, kl_decay, gamma, mode,
    chunk_blocks, segment_chunks, threads,
    ignore_index, label_smoothing, z_loss_scale
    (ObjectiveConfig.with_overrides).
    The tensors of each call fill in the layout and head sizes; the whole
    config is validated then.
    """
    if config is None:
        base = ObjectiveConfig.default()
    elif isinstance(config, ObjectiveConfig):
        base = config
    elif isinstance(config, os.PathLike) or (
        isinstance(config, str) and _names_a_path(config)
    ):
        base = ObjectiveConfig.from_file(os.fspath(config))
    elif isinstance(config, str):
        if not config.strip():
            raise ValueError(
                "config: an empty str; pass None for the default config, "
                "text format or a path")
        base = ObjectiveConfig.from_text(config, "config")
    else:
        raise TypeError(
            "config: must be None, an ObjectiveConfig, text format or a path, "
            f"got {type(config).__name__}"
        )
    return base.with_overrides(**overrides) if overrides else base
