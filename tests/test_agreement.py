from trainloop.distributed.agreement import ExitAgreement


def test_without_a_process_group_a_request_holds_at_once():
    agreement = ExitAgreement()
    assert not agreement.active
    assert agreement.settle(0) == 0
    assert agreement.settle(144) == 144
    agreement.close()  # nothing in flight: a no-op
# The multi-rank behaviour (agreed one step later on every rank) runs for real in
# tests/test_trainer_ddp.py with two gloo processes.
