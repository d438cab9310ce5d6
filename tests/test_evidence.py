"""Evidence of a lie, checked from the liar's own statements alone (protocol/transport/evidence.py):
what proves a lie convicts its author, and nothing else convicts anyone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adloco.protocol.transport.evidence import (
    DROPPED,
    EQUIVOCATED,
    MAX_EVIDENCE_BODY,
    Evidence,
)
from adloco.protocol.transport.identity import create_identity
from adloco.protocol.transport.statements import (
    ANSWER,
    COMMIT,
    PROJECT,
    RECEIPT,
    REVEAL,
    AnswerStatement,
    BadStatement,
    KeyRing,
    Receipt,
    Signed,
    Signer,
)

GROUP = b"g" * 32


@pytest.fixture(scope="module")
def signers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Signer, Signer]:
    folder: Path = tmp_path_factory.mktemp("keys")
    return Signer(create_identity(str(folder / "liar.key"))), Signer(
        create_identity(str(folder / "other.key"))
    )


def _statement(signer: Signer, kind: str, *rest: Any, round: int = 7, group: bytes = GROUP) -> Signed:
    return signer.sign([kind, round, group, signer.peer_id, *rest])


def _answer(signer: Signer, contributors: list[str], commitments: list[bytes], round: int = 7) -> Signed:
    return AnswerStatement.make(
        signer,
        round=round,
        group_id=GROUP,
        keys=["embed"],
        payloads=[b"answer"],
        contributors=contributors,
        commitments=commitments,
        codes=[{}],
        rule="mean",
        outlier_factor=10.0,
        work_cap=None,
        reports=b"",
    ).signed


@pytest.mark.parametrize("kind", [COMMIT, REVEAL, PROJECT])
def test_two_different_statements_of_one_round_convict_their_author(
    signers: tuple[Signer, Signer], kind: str
) -> None:
    liar, _ = signers
    evidence = Evidence.equivocated(kind, _statement(liar, kind, "a"), _statement(liar, kind, "b"))
    peer, why = evidence.check(KeyRing())
    assert peer == liar.peer_id and "round 7" in why
    again = Evidence.from_wire(evidence.to_wire())  # as it travels
    assert again == evidence and again.check(KeyRing())[0] == liar.peer_id


def test_two_answers_convict_only_for_the_same_parts(signers: tuple[Signer, Signer]) -> None:
    """An owner also answers a dead owner's parts in the same round: two answers of other parts are
    no lie; two of the same parts that differ are."""
    liar, _ = signers
    same = Evidence.equivocated(
        ANSWER, _statement(liar, ANSWER, ["a"], 1), _statement(liar, ANSWER, ["a"], 2)
    )
    assert same.check(KeyRing())[0] == liar.peer_id
    other_parts = Evidence.equivocated(
        ANSWER, _statement(liar, ANSWER, ["a"], 1), _statement(liar, ANSWER, ["b"], 2)
    )
    with pytest.raises(BadStatement):
        other_parts.check(KeyRing())


@pytest.mark.parametrize(
    "case",
    ["same body", "another round", "another group", "another author", "another kind", "forged signature"],
)
def test_what_proves_no_lie_convicts_nobody(signers: tuple[Signer, Signer], case: str) -> None:
    liar, other = signers
    first = _statement(liar, REVEAL, "a")
    second = {
        "same body": first,
        "another round": _statement(liar, REVEAL, "b", round=8),
        "another group": _statement(liar, REVEAL, "b", group=b"h" * 32),
        "another author": _statement(other, REVEAL, "b"),
        "another kind": _statement(liar, PROJECT, "b"),
        "forged signature": Signed(_statement(liar, REVEAL, "b").body, first.signature, first.public_key),
    }[case]
    with pytest.raises(BadStatement):
        Evidence.equivocated(REVEAL, first, second).check(KeyRing())


def test_a_statement_in_another_peers_name_convicts_nobody(signers: tuple[Signer, Signer]) -> None:
    """Two statements naming the liar, signed by another key: the other key cannot sign for it."""
    liar, other = signers
    forged = [other.sign([REVEAL, 7, GROUP, liar.peer_id, x]) for x in ("a", "b")]
    with pytest.raises(BadStatement):
        Evidence.equivocated(REVEAL, *forged).check(KeyRing())


def test_a_receipt_and_an_answer_leaving_the_member_out_convict_the_owner(
    signers: tuple[Signer, Signer],
) -> None:
    owner, member = signers
    commitment = b"c" * 32
    receipt = Receipt.make(
        owner, round=7, group_id=GROUP, member=member.peer_id, commitment=commitment
    ).signed
    without = _answer(owner, [owner.peer_id], [b"o" * 32])
    peer, why = Evidence.dropped(receipt, without).check(KeyRing())
    assert peer == owner.peer_id and "after signing their receipt" in why
    ordered = sorted([owner.peer_id, member.peer_id])
    other_commitment = _answer(
        owner, ordered, [b"x" * 32 if p == member.peer_id else b"o" * 32 for p in ordered]
    )
    assert Evidence.dropped(receipt, other_commitment).check(KeyRing())[0] == owner.peer_id
    kept = _answer(owner, ordered, [commitment if p == member.peer_id else b"o" * 32 for p in ordered])
    with pytest.raises(BadStatement):
        Evidence.dropped(receipt, kept).check(KeyRing())  # it kept the member: no lie
    with pytest.raises(BadStatement):
        Evidence.dropped(receipt, _answer(owner, [owner.peer_id], [b"o" * 32], round=8)).check(KeyRing())
    with pytest.raises(
        BadStatement
    ):  # another peer's answer leaving the member out proves nothing of the owner
        Evidence.dropped(receipt, _answer(member, [member.peer_id], [b"o" * 32])).check(KeyRing())


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        ["nonsense", RECEIPT, [b"", b"", b""], [b"", b"", b""]],
        [EQUIVOCATED, RECEIPT, [b"", b"", b""], [b"", b"", b""]],
        [DROPPED, REVEAL, [b"", b"", b""], [b"", b"", b""]],
        [EQUIVOCATED, REVEAL, [b"x" * (MAX_EVIDENCE_BODY + 1), b"", b""], [b"", b"", b""]],
        [EQUIVOCATED, REVEAL, [b"", b""], [b"", b"", b""]],
        [EQUIVOCATED, REVEAL, ["text", b"", b""], [b"", b"", b""]],
    ],
)
def test_malformed_evidence_is_refused_before_any_check(wire: Any) -> None:
    with pytest.raises(BadStatement):
        Evidence.from_wire(wire)
