"""Command line: ``python -m loadtest run|compare|report`` (``make loadtest`` / ``make loadtest-compare``)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from loadtest.profiles import DEFAULT_HOST, DEFAULT_PROFILE, PROFILES, SCENARIOS, SLO
from loadtest.runner import LoadOptions, print_result, run_compare, run_load


def parse_duration(text: str) -> float:
    """'90', '90s', '3m', '1h30m' -> seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"bad duration {text!r} (use e.g. 90, 90s, 3m, 1h30m)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def parse_tags(text: str) -> list[str]:
    tags = [t for t in re.split(r"[,\s]+", text) if t]
    unknown = sorted(set(tags) - set(SCENARIOS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenario tag(s) {unknown}; known: {', '.join(SCENARIOS)}")
    return tags


def add_slo_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLOs (default: the profile's)")
    group.add_argument("--slo-ttft", type=float, help="seconds")
    group.add_argument("--slo-tpot", type=float, help="seconds")
    group.add_argument("--slo-e2e", type=float, help="seconds")
    group.add_argument("--min-attainment", type=float, help="fraction of requests that must meet the SLO")


def slo_from(args: argparse.Namespace, base: SLO) -> SLO | None:
    """``base`` with the SLO options given on the command line; None when none was given."""
    given = {k: v for k, v in (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot), ("e2e_s", args.slo_e2e),
                               ("min_attainment", args.min_attainment)) if v is not None}
    if not given:
        return None
    return SLO(**{**base.__dict__, **given})


def add_load_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                        help="lengths, mix, users, duration and SLOs (loadtest/profiles.py)")
    parser.add_argument("--users", type=int, help="concurrent users (open loop: the in-flight cap)")
    parser.add_argument("--duration", type=parse_duration, help="e.g. 90s, 3m")
    parser.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    parser.add_argument("--tags", type=parse_tags, default=[], help=f"scenarios, comma-separated: {','.join(SCENARIOS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, help="default: runs/<time>-<profile>")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="engine parameter for a server the load test starts")
    parser.add_argument("--drain-timeout", type=float, help="seconds to let in-flight requests finish at the end")
    parser.add_argument("--prefix-key", action="store_true",
                        help="send x-prefix-key so that a proxy keeps each shared-prefix group on one replica")
    add_slo_options(parser)


def options_from(args: argparse.Namespace, argv: list[str]) -> LoadOptions:
    return LoadOptions(profile=args.profile, host=getattr(args, "host", DEFAULT_HOST),
                       metrics_url=getattr(args, "metrics_url", None), users=args.users, duration_s=args.duration,
                       rate=args.rate, tags=args.tags, seed=args.seed, run_dir=args.run_dir,
                       server=getattr(args, "server", "start"), params=dict(p.split("=", 1) for p in args.param),
                       drain_timeout_s=args.drain_timeout, slo=slo_from(args, PROFILES[args.profile].slo),
                       command="python -m loadtest " + shlex.join(argv), prefix_key=args.prefix_key)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one headless run against a server (started if none is up)")
    add_load_options(run)
    run.add_argument("--host", default=DEFAULT_HOST, help="the server's gRPC address")
    run.add_argument("--metrics-url", help="default: http://<host>:8002/metrics, or every replica's when --host is "
                                           "the proxy of `make cluster`; comma-separated for several servers")
    run.add_argument("--server", choices=("auto", "start", "existing"), default="auto",
                     help="auto: use the server at --host if it is up, else start one (and stop it after)")
    compare = sub.add_parser("compare", help="the same seeded mix against batching=continuous and =static")
    add_load_options(compare)
    rep = sub.add_parser("report", help="(re)write a run folder's report")
    rep.add_argument("run_dir", type=Path)
    add_slo_options(rep)
    args = parser.parse_args(argv)

    if args.command == "report":
        from loadtest import report

        # Options override the run's own SLO (run.json), field by field.
        summary = report.write_report(args.run_dir, slo_from(args, report.resolve_slo(args.run_dir)))
        print(report.table(summary))
        print(f"Result: {report.verdict(summary)}".replace("**", ""))
        return 0 if summary.passed else 1
    options = options_from(args, argv)
    if args.command == "run":
        result = run_load(options)
        print_result(result)
        return result.exit_code
    results, path = run_compare(options)
    print(f"\n{path.read_text()}\nComparison: {path}")
    return 0 if all(r.summary.overall.failed == 0 and r.back_to_idle for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
