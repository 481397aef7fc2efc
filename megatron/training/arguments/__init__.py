"""The trainer's command line: :func:`parse_args` parses (:mod:`.parser`) and validates
(:mod:`.validation`)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional

from megatron.training.arguments.parser import (build_parser, expand_model_args_file,
                                                explicit_dests)
from megatron.training.arguments.validation import ArgumentError, validate_args


def parse_args(argv: Optional[List[str]] = None,
               extra_args_provider: Optional[Callable] = None,
               validate: bool = True) -> argparse.Namespace:
    """Parse (``sys.argv[1:]`` by default) and validate; bad combinations exit with a message
    (status 2, printed by rank 0 only: :class:`.parser.RankAwareParser`).

    ``--model-args-file PATH``: the file's flags are read in front of the command line (a value
    given in both is the command line's; a switch the file turns on stays on); they count as
    given.

    Also records ``args.explicit_flags``, the dests given on the command line (see
    :func:`.parser.flags_given`)."""
    parser = build_parser(extra_args_provider)
    if argv is None:
        argv = sys.argv[1:]
    try:  # --model-args-file: its flags first, so the command line's win
        argv = expand_model_args_file(argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    args.explicit_flags = explicit_dests(parser, argv)
    if validate:
        try:
            validate_args(args)
        except ArgumentError as e:
            parser.error(str(e))
    return args
