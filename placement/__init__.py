"""Expert-usage profiles, the placement planner, and their command lines (`strata profile`, `strata plan`)."""
from .budget import BudgetError, GpuBudget, ModelSizes
from .placement import GpuPlacement, Placement, PlacementError
from .planner import Budgets, CostModel, Speeds, plan
from .profile import ExpertProfile, ProfileError, model_id

__all__ = ["BudgetError", "Budgets", "CostModel", "ExpertProfile", "GpuBudget", "GpuPlacement", "ModelSizes",
           "Placement", "PlacementError", "ProfileError", "Speeds", "model_id", "plan"]
