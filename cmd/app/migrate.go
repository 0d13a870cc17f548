package main

import "context"

type migrateCmd struct {
	DB dbSettings `embed:""`
}

func (m *migrateCmd) Run(ctx context.Context, d deps) error {
	pool, err := m.DB.open(ctx, d, true)
	if err != nil {
		return err
	}
	pool.Close()
	return nil
}
