"""Learnable generated text for the tiny presets: a Markov chain over a small vocabulary.

Each token has a few likely successors, so a model can learn the text (next-token prediction
for GPT, filling in masked tokens for BERT) but cannot memorise it, and the best any model can
do is known in closed form (the chain's entropy rate).
"""

from __future__ import annotations

import numpy as np


def transitions(vocab: int, successors: int, first: int = 1, seed: int = 7) -> np.ndarray:
    """A (vocab, vocab) row-stochastic table: each token moves to `successors` tokens drawn from
    [first, vocab) (ids below `first` are special tokens the chain never emits) with Dirichlet(0.5) odds."""
    rng = np.random.default_rng(seed)
    table = np.zeros((vocab, vocab))
    for token in range(vocab):
        chosen = rng.choice(np.arange(first, vocab), successors, replace=False)
        table[token, chosen] = rng.dirichlet(np.full(successors, 0.5))
    return table


def entropy_rate(table: np.ndarray) -> float:
    """Nats per token: the lowest log perplexity any next-token model can reach on the chain."""
    stationary = np.linalg.matrix_power(table, 200)[0]
    logs = np.log(np.where(table > 0, table, 1))
    return float(-(stationary[:, None] * table * logs).sum())


def walk(table: np.ndarray, start: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`length` tokens of the chain, starting at token `start`."""
    cumulative = table.cumsum(axis=1)
    tokens = np.empty(length, dtype=np.int64)
    token = start
    for t, u in enumerate(rng.random(length)):
        tokens[t] = token
        token = min(int(np.searchsorted(cumulative[token], u)), len(table) - 1)
    return tokens
