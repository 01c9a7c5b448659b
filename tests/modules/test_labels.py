import pytest
import torch

from logitless.modules import shift_labels


def test_shift_matches_slicing():
    labels = torch.randint(0, 50, (3, 9))
    labels[0, :4] = -100
    shifted = shift_labels(labels)
    assert torch.equal(shifted[:, :-1], labels[:, 1:])
    assert (shifted[:, -1] == -100).all()


def test_shift_respects_packed_document_boundaries():
    # two documents packed in one row: positions restart at 0 where the second starts
    labels = torch.tensor([[10, 11, 12, 20, 21, -100]])
    input_pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    got = shift_labels(labels, input_pos=input_pos)
    assert got.tolist() == [[11, 12, -100, 21, -100, -100]]


def test_shift_rejects_mismatched_positions():
    with pytest.raises(ValueError, match="input_pos must have the shape of labels"):
        shift_labels(torch.zeros(2, 4, dtype=torch.long), input_pos=torch.zeros(2, 3, dtype=torch.long))
