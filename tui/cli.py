"""memra-tui [--socket PATH] [--replay FILE]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memrad.protocol import default_socket_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memra-tui", description="live inspector of memrad's cache decisions")
    parser.add_argument("--socket", help=f"the daemon's control socket (default: {default_socket_path()})")
    parser.add_argument("--replay", type=Path, help="show a file written by `memrad start --record FILE`")
    parser.add_argument("--screenshot", type=Path, metavar="SVG",
                        help="run headless, save the screen as SVG after --after seconds, and exit")
    parser.add_argument("--after", type=float, default=3.0, help="seconds before --screenshot (default 3)")
    args = parser.parse_args(argv)

    from tui.app import MemraApp
    from tui.client import replay_records, socket_records

    if args.replay is not None:
        if not args.replay.is_file():
            print(f"memra-tui: no such recording: {args.replay}", file=sys.stderr)
            return 2
        app = MemraApp(lambda: replay_records(args.replay), title=f"replay of {args.replay}")
    else:
        path = args.socket or default_socket_path()
        app = MemraApp(lambda: socket_records(path), title=f"connecting to {path}")
    if args.screenshot is not None:
        app.screenshot_after(args.after, args.screenshot)
        app.run(headless=True, size=(150, 44))
        print(f"saved {args.screenshot}")
        return 0
    app.run()
    return 0
