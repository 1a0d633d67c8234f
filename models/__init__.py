"""The formal model of the extent/room protocol (see issue: models/)."""

# The variants whose rules are a subclass of `Spec` register it as they load: loaded here, before any
# module of the package, so `Spec(Config(variant="seed"))` always finds the seed's rules.
from . import seed as seed
