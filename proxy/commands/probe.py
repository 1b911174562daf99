"""``crosstalk probe``: concurrent traffic as synthetic tenants; every answer checked for
other tenants' canaries, entities and text."""

from __future__ import annotations

import argparse
import asyncio
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="engine or crosstalk proxy base URL")
    p.add_argument("--tenants", type=int, default=4, help="synthetic tenants (default 4)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--requests", type=int, default=200, help="requests in all (default 200)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--max-tokens", type=int, default=160, help="per answer (default 160)")
    p.add_argument("--stream", action="store_true", help="streamed (SSE) requests")
    p.add_argument(
        "--determinism",
        action="store_true",
        help="send a sample again alone at temperature 0 and compare with the answers under load",
    )
    p.add_argument("--sample", type=int, default=10, help="determinism sample size (default 10)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--api-key", help="one real API key for all tenants (default: synthetic keys)")
    p.add_argument("--seed", type=int, help="seed of the synthetic data (default: random)")
    p.add_argument("--config", help="crosstalk TOML config: detection settings as the proxy's")
    p.add_argument("--evidence", metavar="DIR", help="write an evidence record into DIR")


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 no contamination, 1 contamination found, 2 error or inconclusive."""
    from proxy.assurance.audit import AdvisoryError, assess, identify, load_advisories
    from proxy.assurance.probe import (
        ProbeError,
        ProbeParams,
        ProbeProgress,
        probe_engine,
        probe_record,
        render,
        run_probe,
    )
    from proxy.config import ConfigError, load

    params = ProbeParams(
        target=args.target,
        tenants=args.tenants,
        concurrency=args.concurrency,
        requests=args.requests,
        model=args.model,
        max_tokens=args.max_tokens,
        stream=args.stream,
        determinism=args.determinism,
        sample=args.sample,
        timeout=args.timeout,
        api_key=args.api_key,
        seed=args.seed,
    )
    try:
        engine, detection = probe_engine(load(args.config) if args.config else None)
    except ConfigError as e:
        print(f"crosstalk probe: {e}", file=sys.stderr)
        return 2
    ident = asyncio.run(identify(args.target, api_key=args.api_key, timeout=10.0))
    engine_line = f"{ident.engine or 'engine not identified'} {ident.version or ''}".strip()
    try:
        result = asyncio.run(run_probe(params, engine, progress=ProbeProgress))
    except ProbeError as e:
        print(f"crosstalk probe: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render(result, engine_line))
    status = 1 if result.contaminated else 2 if result.inconclusive else 0
    if args.evidence:
        from proxy.assurance.evidence import EvidenceError, new_record, sha256, write_evidence

        body = probe_record(result)
        body["identification"] = ident.to_json()
        try:
            db = load_advisories()
            body["assessments"] = [a.to_json() for a in assess(ident, db)]
        except AdvisoryError as e:
            body["assessments_error"] = str(e)
        body.update(verdict=result.verdict(), exit_status=status)
        config = {"detection": detection, "probe": params.to_json()}
        if args.config:
            with open(args.config, "rb") as fh:
                config["crosstalk_config"] = {"path": args.config, "sha256": sha256(fh.read())}
        try:
            written = write_evidence(args.evidence, new_record("probe", args.target, body, config))
        except EvidenceError as e:
            print(f"crosstalk probe: {e}", file=sys.stderr)
            return 2
        print(f"evidence: {written.directory} (record sha256 {written.record_sha256})")
    return status
