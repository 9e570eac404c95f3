"""``dense-bridge verify OUT``: re-check a port's certificate (``db.verify_port``). Exit 0 every
entry holds, 1 naming each tensor or file that does not, 2 bad input (no certificate)."""
from __future__ import annotations

from .. import ports
from ._common import EXIT_NOT_EQUIVALENT, EXIT_OK, emit_json


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="re-check a port's certificate (exit 1 naming what does not hold)",
                       description="Re-read OUT and the source files its port_certificate.json names; confirm "
                                   "every file hash and every tensor (recomputed from its sources). Exit 0 all "
                                   "hold, 1 naming each tensor or file that does not, 2 bad input.")
    p.add_argument("out", metavar="OUT", help="a directory written by dense-bridge port")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    report = ports.verify_port(args.out)
    if args.json:
        emit_json(report.to_dict())
    else:
        print(report)
    return EXIT_OK if report.passed else EXIT_NOT_EQUIVALENT
