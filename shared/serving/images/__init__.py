"""A client's image, as a data URL, made into checked RGB pixels and a content key."""
