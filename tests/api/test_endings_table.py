"""The endings table in code (celery_idem.endings): which ending an exception means, which store
step each ending takes, and that the table and the endings matrix (tests/endings.py, run through real
workers by tests/worker/test_endings.py) name the same endings."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from endings import ENDINGS

from celery_idem import Idempotency, IdempotentTask, PermanentError, RetryableError
from celery_idem.endings import HARD_KILLS, IDEMPOTENT, Answer, Ending, Mode, Step, ending_of
from celery_idem.records import Decision
from celery_idem.stores.memory import MemoryStore


def permanent(exc: BaseException) -> bool:
    return isinstance(exc, (PermanentError, Ignore)) or (isinstance(exc, Reject) and not exc.requeue)


SENT = object()  # the retry's signature: self.retry() sent it


class BareRetry(Retry):
    """A Retry subclass that never called Retry.__init__: it has no signature at all."""

    def __init__(self) -> None:
        Exception.__init__(self, "bare")


@pytest.mark.parametrize(
    ("exc", "replaced", "acks_late", "ending"),
    [
        (Retry(sig=SENT), False, False, Ending.RETRIED),
        (Retry(sig=SENT), True, True, Ending.RETRIED),
        (Retry(), False, True, Ending.DROPPED),  # raised by hand: no retry was sent
        (BareRetry(), False, False, Ending.DROPPED),
        (Ignore(), True, False, Ending.REPLACED),
        (Ignore(), False, False, Ending.PERMANENT),
        (Reject(requeue=True), False, True, Ending.REQUEUED),
        (Reject(requeue=True), False, False, Ending.DROPPED),
        (Reject(requeue=False), False, True, Ending.PERMANENT),
        (PermanentError("no"), False, False, Ending.PERMANENT),
        (RetryableError("later"), False, False, Ending.RETRYABLE),
        (SoftTimeLimitExceeded(), False, False, Ending.RETRYABLE),
        (KeyboardInterrupt(), False, False, Ending.RETRYABLE),
        (SystemExit(1), False, True, Ending.RETRYABLE),
        # Raised by a body (the hard limit and a lost worker never reach the body): a failure as any other.
        (TimeLimitExceeded(), False, False, Ending.RETRYABLE),
    ],
)
def test_the_ending_an_exception_means(exc: BaseException, replaced: bool, acks_late: bool, ending: Ending) -> None:
    assert ending_of(exc, permanent=permanent, replaced=replaced, acks_late=acks_late) is ending


def test_an_eager_call_has_no_message_to_requeue() -> None:
    assert ending_of(Reject(requeue=True), permanent=permanent, acks_late=True, eager=True) is Ending.DROPPED
    assert ending_of(Retry(sig=SENT), permanent=permanent, eager=True) is Ending.RETRIED  # Celery runs it next


def test_the_parent_sees_a_killed_attempt_by_its_hard_kills() -> None:
    assert set(HARD_KILLS) == {WorkerLostError, TimeLimitExceeded}
    assert IDEMPOTENT.after[Ending.KILLED] is IDEMPOTENT.after[Ending.REVOKED] is Step.RELEASE_STALE


def test_the_idempotent_mode_stores_outcomes_and_frees_keys_only_after_retryable_endings() -> None:
    after = IDEMPOTENT.after
    assert after[Ending.RETURNED] is Step.COMPLETE and after[Ending.PERMANENT] is Step.FAIL
    assert {e for e, step in after.items() if step is Step.RELEASE} == {Ending.RETRYABLE, Ending.DROPPED}
    assert {e for e, step in after.items() if step is Step.REQUEUE} == {Ending.RETRIED, Ending.REQUEUED}
    assert dict(IDEMPOTENT.duplicate) == {
        Decision.REPLAY: Answer.REPLAY,
        Decision.BUSY: Answer.WAIT,
        Decision.MISMATCH: Answer.REFUSE,
    }


def test_every_ending_in_code_is_a_row_of_the_matrix() -> None:
    """A new ending is a row of both: the matrix runs it through real workers, the table settles it."""
    taken = {code for row in ENDINGS for code in row.takes}
    assert taken == set(Ending), f"endings no row of tests/endings.py takes: {set(Ending) - taken}"


def test_a_mode_must_say_what_every_ending_does() -> None:
    partial = MappingProxyType({e: s for e, s in IDEMPOTENT.after.items() if e is not Ending.DROPPED})
    with pytest.raises(ValueError, match="mode 'partial' says nothing of the endings DROPPED"):
        Mode("partial", after=partial, duplicate=IDEMPOTENT.duplicate)


class GiveUp(Retry, PermanentError):
    """A Retry the task calls permanent."""


@pytest.mark.parametrize(
    ("exc", "step"),
    [
        (PermanentError("no"), Step.FAIL),
        (GiveUp(), Step.FAIL),
        (ValueError("x"), Step.RELEASE),
        (Retry(sig=SENT), Step.RELEASE),
    ],
    ids=["permanent", "permanent-retry", "retryable", "retry"],
)
def test_a_replacements_failure_is_permanent_or_retryable_whatever_else_its_class_is(
    exc: BaseException, step: Step
) -> None:
    """On the replacement's error link no message of the replaced attempt carries the call on: its
    failure is classed as any failure, permanent first (found by an attack: a Retry that is also
    permanent freed the key)."""
    app = Celery("endings-table", set_as_current=False)
    Idempotency(app, store=MemoryStore(), default_failure="retryable")

    @app.task(base=IdempotentTask, shared=False, name="endings.table")
    def table() -> None:
        pass

    assert app.tasks["endings.table"].idempotency_handler.settle.failure_step(exc) is step
