"""A request that continues an open sequence (what each ``mlxkv chat`` turn is), with the fake runner and pool of
test_scheduler_plan (no model): its prefill starts at the sequence's offset, the prefix is counted as cached, and
the sequence stays open however the request ends."""

from test_scheduler_plan import FakePool, FakeRunner, FakeSeq, job, scheduler, tokens

from mlxkv.engine.request import Event


class OpenSeq(FakeSeq):
    """A fake sequence whose caches hold ``length`` tokens (a dense sequence's offset)."""

    @property
    def offset(self):
        return self.length


def open_sequence(pool, cached):
    seq = OpenSeq(pool, 99, 0, None)
    seq.length = cached
    pool.seqs[seq.id] = seq
    return seq


def test_a_continued_sequence_prefills_only_past_its_offset_and_stays_open():
    pool, runner = FakePool(64), FakeRunner()
    sched = scheduler(pool, runner, prefill_chunk_size=16, last_token_alone=True)  # as chat runs it
    seq = open_sequence(pool, 6)
    turn = job(range(10, 20), max_tokens=3)
    turn.sequence = seq
    sched.add(turn)
    while sched.has_work():
        sched.step()
    prefilled = [(c.start, c.end) for p in runner.plans for c in p.prefills]
    assert prefilled == [(6, 9), (9, 10)]  # the prompt past the 6 cached tokens (its last token alone)
    assert turn.cached_tokens == 6 and tokens(turn) == [0, 7, 7] and turn.finished
    assert seq.id in pool and turn.opened == []  # nothing opened for the request; its sequence is still open

    held = seq.length  # the prompt and the answer tokens fed back
    again = job(range(10, 30), max_tokens=50)  # the next turn continues it, and is cancelled mid-answer
    again.sequence = seq
    sched.add(again)
    plans = len(runner.plans)
    sched.step()
    sched.end_all(Event("error", finish_reason="cancelled", message="cancelled"), "cancelled")
    assert [c.start for p in runner.plans[plans:] for c in p.prefills][0] == held == again.cached_tokens
    assert again.finished and seq.id in pool
