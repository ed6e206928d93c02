"""Paper settings shared by several config files: sizes, optimizers and the `tiny` sizes, per paper.

Model modules hold only architecture; what a paper trained with, at which size, lives here.
"""
