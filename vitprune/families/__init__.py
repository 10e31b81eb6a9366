"""The timm model families vitprune patches, one module each; importing this package
registers them (``vitprune.core.registry``). Adding a family is one new module here, with
its pruning block classes, its patched model class and one ``register(Family(...))`` call,
and its import below."""

from . import vit, eva, relpos  # noqa: F401  (each registers its family)

__all__ = ["vit", "eva", "relpos"]
