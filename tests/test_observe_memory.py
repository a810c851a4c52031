"""Model-state and saved-activation byte counting."""

import torch

from course_lib.observe.memory import SavedActivations, measured_state_bytes
from course_lib.model import GPT, GPTConfig


def test_measured_state_bytes_fp32_adamw_is_16_bytes_per_param():
    model = GPT(GPTConfig.tiny(vocab_size=50))
    opt = torch.optim.AdamW(model.parameters())
    n = model.num_params()
    assert measured_state_bytes(model, opt) == {"params": 4 * n, "grads": 0, "optimizer": 0, "total": 4 * n}
    x = torch.randint(0, 50, (2, 8))
    model(x, x)[1].backward()
    opt.step()
    got = measured_state_bytes(model, opt)
    assert got == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "total": 16 * n}


def test_tied_weights_count_once():
    tied = GPT(GPTConfig.tiny(vocab_size=50))
    untied = GPT(GPTConfig.tiny(vocab_size=50, tie_weights=False))
    assert measured_state_bytes(untied)["params"] - measured_state_bytes(tied)["params"] == 4 * 50 * 64


def test_saved_activations_of_a_linear_layer():
    layer = torch.nn.Linear(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedActivations(layer) as saved:
        y = torch.relu(layer(x))
    # linear saves its input (4x16), relu saves its output (4x32); the weight is excluded
    assert saved.bytes == 4 * (4 * 16 + 4 * 32)
    assert saved.by_shape() == {((4, 16), "float32"): 1, ((4, 32), "float32"): 1}
    y.sum().backward()  # the hooks hand the tensors back unchanged
    assert x.grad.shape == (4, 16)


def test_saved_activations_grow_linearly_with_batch():
    model = GPT(GPTConfig.tiny(vocab_size=50))
    sizes = []
    for batch in (1, 2, 4):
        x = torch.randint(0, 50, (batch, 16))
        with SavedActivations(model) as saved:
            model(x, x)
        sizes.append(saved.bytes)
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0])  # linear in the batch size
    assert sizes[0] < sizes[1] < sizes[2]


def test_no_grad_saves_nothing():
    model = GPT(GPTConfig.tiny(vocab_size=50))
    with torch.no_grad(), SavedActivations(model) as saved:
        model(torch.randint(0, 50, (2, 16)))
    assert saved.bytes == 0
