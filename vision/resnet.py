"""The CIFAR-style ResNet-18 of the paper's vision experiments (He et al. 2016, as kuangliu/pytorch-cifar).

The reference (AGI-Arena/MARS, MARS/utils/model_CNN.py) adapts ResNet to 32x32 images: a 3x3 stride-1
stem without max-pooling, four stages of BasicBlocks at 64/128/256/512 channels (stride 2 from the
second stage on), a 4x4 average pool and one linear classifier. `width` scales every stage's channels
(64 is the paper's; the CPU study uses a narrow 16) and `blocks` sets the blocks per stage.

Parameter shapes decide MARS's routing: every convolution kernel is 4-D, the classifier's weight is the
only 2-D tensor, and the BatchNorm weights and biases and the classifier's bias are 1-D.
"""

import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (1x1 projection when the shape changes)."""

    def __init__(self, in_channels, channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(channels),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, num_classes=10, width=64, blocks=(2, 2, 2, 2)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages = []
        in_channels = width
        for stage, num_blocks in enumerate(blocks):
            channels = width * 2**stage
            strides = [1 if stage == 0 else 2] + [1] * (num_blocks - 1)
            layers = []
            for stride in strides:
                layers.append(BasicBlock(in_channels, channels, stride))
                in_channels = channels
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(in_channels, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, 4)  # 32x32 input: the last stage is 4x4, so this is a global pool
        return self.linear(out.flatten(1))
