"""Data and models that ship with vitprune: Fashion-MNIST and cluttered loaders, the small
ViTs in ``vitprune/assets``, their accuracy, and picture files as model inputs."""

#: The datasets of the shipped models (``datasets.load``).
DATASETS = ("fashion_mnist", "cluttered")
