"""The formal model of the slot/room protocol (see issue: models/)."""
