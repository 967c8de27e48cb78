"""The seed's helpers for nested records, at the path its users import them from (``trainloop.utils``).

``from trainloop.utils import key_average`` keeps working; they live in ``trainloop.nested``.
"""

from trainloop._moved import moved_names
from trainloop.nested import flatten_nested_dict, key_average, map_nested_tensor

__all__ = ["flatten_nested_dict", "key_average", "map_nested_tensor"]

__getattr__ = moved_names(__name__)  # names that moved, still importable (see trainloop._moved)
