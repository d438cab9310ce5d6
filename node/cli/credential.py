"""`adloco-node credential`: the run owner's and the volunteer's tools for a private run.

    adloco-node credential owner --key owner.key          # the run owner: make a key, print its id
    adloco-node credential peer-id --identity-path n.key  # a volunteer: make an identity, print its id
    adloco-node credential issue --key owner.key --run-id r --peer-id Qm... --days 30 > n.cred
    adloco-node credential inspect n.cred --run-owner Qm... --run-id r

The volunteer runs its node with `--identity-path n.key --run-owner <owner id> --credential n.cred`;
every node of the run gives the same `--run-owner`. `inspect` prints what a credential says and,
given the run owner and run id, whether a node of that run admits it (exit 1 when not). No
networking; bad input ends with one line and exit code 2, as for the node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ...errors import UserError
from ...protocol.transport.admission import check, issue, read_credential, utc
from ...protocol.transport.identity import create_identity, load_identity
from .node import read_token, usage_error

MAX_DAYS = 3650


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adloco-node credential",
        description="Keys and credentials of a private run (only admitted peers average, serve state"
        " and are believed). The owner id goes to every node's --run-owner.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    owner = sub.add_parser("owner", help="create the run owner's key if missing; print the owner id")
    owner.add_argument("--key", required=True, help="the owner's private key file (keep it secret)")
    peer = sub.add_parser("peer-id", help="create a node identity if missing; print its peer id")
    peer.add_argument("--identity-path", required=True, help="the node's --identity-path file")
    grant = sub.add_parser("issue", help="print a credential admitting one peer to the run")
    grant.add_argument("--key", required=True, help="the owner's private key file")
    grant.add_argument("--run-id", required=True, help="the run's --run-id")
    grant.add_argument("--peer-id", required=True, help="the peer to admit (its `credential peer-id`)")
    grant.add_argument("--days", type=float, default=30.0, help="valid for this many days from now")
    inspect = sub.add_parser("inspect", help="print what a credential says; check it against a run")
    inspect.add_argument("credential", help="a credential file, or the token itself")
    inspect.add_argument("--run-owner", default=None, help="the run's owner id: check the signer")
    inspect.add_argument("--run-id", default=None, help="the run id: check the run")
    return p


def credential_main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage line
        return int(e.code or 0)
    try:
        return _run(args)
    except UserError as e:
        return usage_error(e)


def _run(args: argparse.Namespace) -> int:
    if args.command in ("owner", "peer-id"):
        path = args.key if args.command == "owner" else args.identity_path
        option = "--key" if args.command == "owner" else "--identity-path"
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UserError(f"{option}: the folder {folder} does not exist")
        try:
            identity = load_identity(path) if os.path.exists(path) else create_identity(path)
        except ValueError as e:
            raise UserError(f"{option}: {e}") from None
        print(identity.peer_id)
        return 0
    if args.command == "issue":
        if not 0 < args.days <= MAX_DAYS:
            raise UserError(f"--days: must be in (0, {MAX_DAYS}], got {args.days:g}")
        if not args.peer_id.isalnum() or not 30 <= len(args.peer_id) <= 64:
            raise UserError(f"--peer-id: {args.peer_id[:70]!r} is not a peer id")
        try:
            owner = load_identity(args.key)
        except ValueError as e:
            raise UserError(f"--key: {e}") from None
        print(issue(owner, run_id=args.run_id, peer_id=args.peer_id, expires=time.time() + args.days * 86400))
        return 0
    token = read_token(args.credential)
    try:
        credential = read_credential(token)
    except ValueError as e:
        raise UserError(f"credential: {e}") from None
    said = {
        "run_id": credential.run_id,
        "peer_id": credential.peer_id,
        "owner": credential.owner,
        "expires": utc(credential.expires),
    }
    verdict = 0
    if args.run_owner is not None or args.run_id is not None:
        try:
            check(
                credential,
                run_id=credential.run_id if args.run_id is None else args.run_id,
                owner=credential.owner if args.run_owner is None else args.run_owner,
            )
            said["admitted"] = "yes"
        except ValueError as e:
            said["admitted"] = f"no: {e}"
            verdict = 1
    print(json.dumps(said, indent=2))
    return verdict


if __name__ == "__main__":
    sys.exit(credential_main(sys.argv[1:]))
