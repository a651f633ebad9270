"""Output constraints: what a request's output must match (JSON schema, regex, grammar, choice), compiled once
per content and enforced token by token while decoding.

``spec`` holds the domain ``Constraint`` and its limits; ``backend`` the seam a grammar engine plugs into;
``llg`` the llguidance backend; ``cache`` compiled grammars under a byte budget; ``masks`` the per-step token
masks, filled beside the forward pass.
"""

from service.constraints.spec import Constraint, ConstraintLimits, check_constraint

__all__ = ["Constraint", "ConstraintLimits", "check_constraint"]
