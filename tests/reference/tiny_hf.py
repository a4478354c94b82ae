"""Helpers for comparing our engine with transformers on tiny random models."""
import torch


def random_prompt(n: int, seed: int, vocab_size: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of exactly `n` tokens."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()
