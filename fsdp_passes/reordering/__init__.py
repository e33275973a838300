"""reordering"""
