"""Scale out on Ray (the ``cluster`` extra): replicas behind one endpoint, and experts held in several machines' RAM."""
