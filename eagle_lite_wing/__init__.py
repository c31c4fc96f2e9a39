"""eagle_lite's wing: features without a measured gain on this project's targets, kept apart from the core package.

Each enters through the core's own seams (an observer of the engine, eagle_lite.decoding.observer; a drafter), is
off by default, and says its measured status in its docstring (docs/adapt.md and docs/methods.md have the figures):

- adapt.py, learner.py, capture.py: online adaptation (`--adapt DIR`): at most +0.5% accepted per step on the weak
  kinds, at 77-115 ms of CPU per answered token.
- traffic.py: a store of the answers served that prompt lookup copies from across requests: 0.96-0.97x.
- auto.py, controller.py: method auto (`--method auto`), each step's proposal chosen from this machine's step
  costs: 0.94x the default (eagle) greedy on the held-out questions, 1.00x and 0.97x sampled at T=0.7 and 1.0.
- parallel.py: the parallel head's drafter (P-EAGLE, K tokens a head forward): 1.71 accepted a step against the
  sequential head's 2.50; 1.29x against 1.56x on the GPU. Only a head saved with `parallel` brings it in.

It registers itself through the core's plugin entry point (plugin.py; eagle_lite.drafters.plugins): the core names
none of it. The training objective the learner minimises is trainers' (trainers/objective.py), packaged beside it.
"""
