"""Sampling completions from a torchtune decoder; :mod:`~logitless.generation.tools`: tool and
environment turns (multi-turn rollouts)."""
