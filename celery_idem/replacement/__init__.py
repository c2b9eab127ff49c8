"""``self.replace()``: the replacement inherits the replaced task's id, and what becomes of its record.

Celery's replace publishes the replacement under the replaced task's own id and ends the replaced
attempt with ``Ignore`` (DESIGN, "Not failures"). Before anything is published, the replaced attempt
hands its IN_PROGRESS record to a fresh token (``Store.hand_over``, fenced by its owner token),
leased for as long as the replacement may take (:func:`_longest_wait`). The token names no worker
process: a duplicate that meets the record knows that nothing runs it yet (a message waits in a
queue), and waits for it through the broker instead of in a worker slot the replacement may need.
Then one of two things settles it:

- **Its own call** (the same task and identity, any arguments: ``self.replace(self.s(x).set(
  queue="heavy"))``, a poll that replaces itself with a countdown or one try later, or the last step
  of a chain): the replacement's message carries the token in the header ``idempotency_handover``
  and, before it acquires, takes the record under its own owner token (``hand_over`` again, fenced
  by the token) and runs at once. The store compares the token, so a forged header is worth nothing
  for the take, and one message only takes it: a copy of the replaced message (no token) or a second
  copy of the replacement (its token is spent) acquires as any copy of the attempt chain does.
- **Anything else** (another task, a group, a chain that ends elsewhere): two callbacks linked to
  the replacement's end settle the record with its outcome, fenced by the token:
  ``celery_idem.replaced`` (link) stores its value; ``celery_idem.replaced_failed`` (link_error,
  a ``(request, exc, traceback)`` errback that Celery calls in the failing worker) stores the
  failure when the replaced task's policy classes it permanent, else frees the key.

If the store cannot take the handover (an outage), nothing is published and the replaced message
is kept (back to the broker, as any message facing an outage); so is it when the replacement's own
claim fails closed. A replacement by its own call that a worker drops as revoked before it ran frees
the key, as any call revoked before it ran does: the revoke hook releases the record fenced by the
token the dropped message carries (:mod:`celery_idem.signals`). Should neither happen (the
replacement lost, or another call revoked: Celery runs no callback of a task it drops, and a dropped
copy cannot prove that the call is not running, the record staying under the token while it runs),
the lease runs out and the reconciler settles the record from the result backend under the same id.
"""

from .callbacks import install, replaced, replaced_failed
from .handover import Handler, on_replace, take_over

__all__ = ["Handler", "install", "on_replace", "replaced", "replaced_failed", "take_over"]
