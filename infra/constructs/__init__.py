"""The stacks' building blocks, one job each, each configured by a typed props dataclass.

Two kinds. ``EngineGroup``, ``EfaLaunchTemplate`` and ``dashboard`` are ``Construct`` subclasses: child nodes
of their stack. The blocks pulled out of the router, image and observability stacks later (``router_access``,
``elasticache_store``, ``router_service``, ``router_alb``, ``engine_image``, ``alarms``) are *scope-preserving*:
plain classes that create their resources directly in the scope they are given (the stack), not in a child
node. Their resources keep the logical ids (and ``aws:cdk:path``) they had when the stack's constructor made
them inline, so pulling them out replaced nothing on deploy; a child construct would have renamed every
logical id under it, and CloudFormation would have replaced each resource.
"""
