"""The ``--l3*`` flags of ``serve`` and ``bench hicache``, and the ``L3Options`` they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import defaults
from ..errors import ConfigError
from ..storage.base import StoreUnavailable
from ..storage.master import parse_address
from ..storage.options import L3Options
from .common import float_range

#: The largest --l3-size-gb (a bound, not an allocation for the file store).
MAX_L3_GB = 1 << 20


def add_l3_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--l3", choices=defaults.L3_BACKENDS, default=default,
                   help="L3 storage behind the host tier: file (embedded), mooncake (Mooncake Store) "
                   "or none (default %(default)s; docs/l3.md)")
    p.add_argument("--l3-dir", default=None, metavar="DIR",
                   help="--l3 file: this deployment's directory (created 0700; default: inside the "
                   "run directory, gone with it)")
    p.add_argument("--l3-size-gb", type=float_range(0.0, MAX_L3_GB, low_open=True),
                   default=defaults.L3_SIZE_GB, metavar="GB",
                   help="L3 bytes for the whole deployment, every stage keeping the same number of "
                   "pages (default %(default)g)")
    p.add_argument("--l3-reset", action="store_true",
                   help="clear the store's stagecache objects at start (a store of another "
                   "deployment is refused without it)")
    p.add_argument("--l3-mooncake-master", default=None, metavar="HOST:PORT",
                   help="--l3 mooncake: an existing master (default: start one on 127.0.0.1)")


def l3_options(args: argparse.Namespace) -> L3Options:
    """Validate the flags (exit 2 naming the flag) into ``L3Options``."""
    backend = args.l3
    if args.l3_mooncake_master and backend != "mooncake":
        raise ConfigError(f"--l3-mooncake-master needs --l3 mooncake (got --l3 {backend})")
    if args.l3_dir and backend != "file":
        raise ConfigError(f"--l3-dir needs --l3 file (got --l3 {backend})")
    if args.l3_dir and Path(args.l3_dir).exists() and not Path(args.l3_dir).is_dir():
        raise ConfigError(f"--l3-dir {args.l3_dir!r} is not a directory")
    if args.l3_mooncake_master:
        try:
            parse_address(args.l3_mooncake_master)
        except StoreUnavailable as exc:
            raise ConfigError(str(exc)) from None
    if backend == "mooncake":
        from ..storage.mooncake import _import_store

        try:
            _import_store()
        except StoreUnavailable as exc:
            raise ConfigError(str(exc)) from None
    return L3Options(backend=backend, dir=args.l3_dir, size_bytes=int(args.l3_size_gb * (1 << 30)),
                     reset=args.l3_reset, mooncake_master=args.l3_mooncake_master)
