"""Models defined in the repo: an MLP, a VGG-16-style CNN, a U-Net and an unrolled LSTM."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 1024, hidden: int = 2048, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(0.1)]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


VGG16_LAYERS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """VGG-16 with BatchNorm (Simonyan & Zisserman), sized for ``image_size`` inputs."""

    def __init__(self, classes: int = 10, image_size: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in VGG16_LAYERS:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, int(v), 3, padding=1), nn.BatchNorm2d(int(v)), nn.ReLU(inplace=True)]
                channels = int(v)
        self.features = nn.Sequential(*layers)
        side = image_size // 32
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(512 * side * side, 512),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(512, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """U-Net (Ronneberger et al.) with four levels and skip connections, for segmentation."""

    def __init__(self, classes: int = 4, base: int = 32) -> None:
        super().__init__()
        widths = [base, base * 2, base * 4, base * 8]
        self.down = nn.ModuleList()
        cin = 3
        for w in widths:
            self.down.append(_double_conv(cin, w))
            cin = w
        self.bottom = _double_conv(widths[-1], widths[-1] * 2)
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        cin = widths[-1] * 2
        for w in reversed(widths):
            self.up.append(nn.ConvTranspose2d(cin, w, 2, stride=2))
            self.merge.append(_double_conv(w * 2, w))
            cin = w
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)


class UnrolledLSTM(nn.Module):
    """A two-layer LSTM language model unrolled over ``steps`` timesteps (OLLA 2.1: loops
    unrolled so the graph is acyclic)."""

    def __init__(self, vocab: int = 1000, hidden: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cells = nn.ModuleList(nn.LSTMCell(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, steps = tokens.shape
        x = self.embed(tokens)
        states = [(x.new_zeros(batch, c.hidden_size), x.new_zeros(batch, c.hidden_size)) for c in self.cells]
        outputs = []
        for t in range(steps):
            h = x[:, t]
            for i, cell in enumerate(self.cells):
                states[i] = cell(h, states[i])
                h = states[i][0]
            outputs.append(h)
        return self.head(torch.stack(outputs, dim=1))
