"""What the ClientApp and the ServerApp both use, and nothing else imports from.

These modules sit below every other pollen package (they import only the
standard library, NumPy, Flower's record types and the catalogue): the
update's clipping to a norm bound, a client's effective local steps,
privacy accountants (epsilon and noise calibration), a link's shape, the partition arithmetic
`Settings` checks, which clients attack, what one run-config value may be,
the line that says a user's slow code is still running, a few names of a
long list.
Both sides import them from here, so neither reaches into the other's
package (docs/architecture.md, "Import rules").
"""
