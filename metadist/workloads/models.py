"""Plain PyTorch models for the ``mlp`` and ``cnn`` built-ins (no transformers needed)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Three Linear layers with GELU between them: a classifier over ``in_features`` inputs."""

    def __init__(self, *, in_features: int, hidden_features: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.fc2 = nn.Linear(hidden_features, hidden_features)
        self.fc3 = nn.Linear(hidden_features, num_classes)
        self.act = nn.GELU()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc1(inputs))  # (B, H)
        hidden = self.act(self.fc2(hidden))  # (B, H)
        return self.fc3(hidden)  # (B, num_classes)


class SmallCNN(nn.Module):
    """Two Conv2d-BatchNorm2d-ReLU-MaxPool2d blocks and a Linear classifier."""

    def __init__(self, *, in_channels: int, image_size: int, channels: int, num_classes: int) -> None:
        super().__init__()
        if image_size % 4 != 0:
            raise ValueError(f"SmallCNN halves the image twice; image_size must be a multiple of 4, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, kernel_size=3, padding=1, bias=False),  # BatchNorm follows: a bias would be redundant
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Linear(2 * channels * side * side, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        features = self.features(inputs)  # (B, 2C, S/4, S/4)
        return self.classifier(features.flatten(1))  # (B, num_classes)
