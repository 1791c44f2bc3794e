"""`python -m deploy.grafana.dashboards`: write every dashboard's JSON into the chart."""

import sys

from deploy.grafana.dashboards import main

sys.exit(main())
