"""cpu_threads: the thread count each recipe gives torch, and its validation."""

import pytest

from logitless.training.config import ConfigError
from logitless.training.threads import check_cpu_threads, resolve_cpu_threads


@pytest.mark.parametrize("cores,local_world_size,expected", [(2, 1, 1), (1, 1, 1), (16, 1, 15), (16, 4, 3),
                                                             (8, 8, 1), (2, 4, 1)])
def test_auto_on_cpu_leaves_one_core_per_process(cores, local_world_size, expected):
    got = resolve_cpu_threads("auto", cpu_math=True, cores=cores, local_world_size=local_world_size, env_threads=None)
    assert got == max(1, cores // local_world_size - 1) == expected


@pytest.mark.parametrize("cores,local_world_size,expected", [(16, 1, 16), (16, 8, 2), (4, 8, 1)])
def test_auto_with_a_gpu_shares_the_cores_among_local_processes(cores, local_world_size, expected):
    got = resolve_cpu_threads("auto", cpu_math=False, cores=cores, local_world_size=local_world_size,
                              env_threads=None)
    assert got == expected


def test_explicit_values_and_the_environment():
    assert resolve_cpu_threads(3, cpu_math=True, cores=2, local_world_size=1, env_threads=None) == 3
    # OMP_NUM_THREADS set by the user (or by torchrun) is kept by auto; an explicit number still wins
    assert resolve_cpu_threads("auto", cpu_math=True, cores=16, local_world_size=1, env_threads=5) is None
    assert resolve_cpu_threads(2, cpu_math=True, cores=16, local_world_size=1, env_threads=5) == 2
    assert resolve_cpu_threads(None, cpu_math=True, cores=16, local_world_size=1, env_threads=None) is None


@pytest.mark.parametrize("value", [0, -1, "all", 1.5, True])
def test_bad_values_name_the_key(value):
    with pytest.raises(ConfigError, match=r"config key 'cpu_threads'.*'auto'"):
        check_cpu_threads(value)
