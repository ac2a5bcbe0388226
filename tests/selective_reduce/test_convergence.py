"""Convergence harness (extension): models average on syncs and training makes progress."""
import numpy as np

from host.experiments.selective_reduce.convergence import CONVERGENCE_COMPUTE_SCALE, Trainer, run
from host.selective_reduce.policies import SelectiveReduce
from host.selective_reduce.simulator import SimConfig, Simulation


class Checking(Trainer):
    """After each sync every member holds the same model, equal to the launch-time mean."""

    def on_sync_end(self, members, t):
        expected = self.pending[tuple(members)].copy()
        super().on_sync_end(members, t)
        for w in members:
            assert np.array_equal(self.models[w], expected)


def test_group_members_share_the_averaged_model():
    cfg = SimConfig(n=10, duration=20.0, seed=0, compute_scale=CONVERGENCE_COMPUTE_SCALE)
    trainer = Checking(cfg.n, target=0.99, seed=0)
    result = Simulation(cfg, SelectiveReduce(), observer=trainer).run()
    assert trainer.syncs == result.total_syncs > 0
    assert trainer.iterations == result.iterations


def test_selective_reduce_reaches_target():
    out = run("selective-reduce", SimConfig(n=10, duration=60.0, seed=0,
                                                compute_scale=CONVERGENCE_COMPUTE_SCALE), target=0.85)
    assert np.isfinite(out.time_to_target) and out.final_accuracy > 0.8
