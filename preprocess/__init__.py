"""Embedded preprocessing workers: placement, transformation reordering and load
balancing. Filed as later issues; the package exists so the distribution layout
is stable."""
