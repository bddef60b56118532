"""Run by every Python process of the tests' Ray heads (tests/rayhead.py puts this directory on
their PYTHONPATH): ray_proxy_spawn says why."""
import ray_proxy_spawn

ray_proxy_spawn.apply()
